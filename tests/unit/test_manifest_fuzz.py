"""Hostile-manifest fuzzing (issue 15, item 7): whatever a state server sends (a manifest with any field of any type,
huge or negative sizes, deep trees, unicode garbage in names, lying lengths, truncated or random bytes, a garbled
HTTP head) and whatever address a peer announces, a fetch by a rank with its own expected structure ends with the
state or a StateFetchError, nothing else. A real socket server on 127.0.0.1 answers every example."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import suppress

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_fthsdp.recovery import wire
from lightning_fthsdp.recovery.client import StateFetchError, fetch_state
from lightning_fthsdp.recovery.expected import Counters, expect
from lightning_fthsdp.recovery.torch_state import optimizer_state
from tests.unit.test_transport import body, encode, http_200

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_MODEL = torch.nn.Linear(4, 3)
LOCAL = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3)}, "optimizer": optimizer_state(
    torch.optim.Adam(_MODEL.parameters())), "counters": {"step": 0, "seen": Counters()}, "rng": [3, [1, 2], None]}
SOURCE = {"model": {"w": torch.randn(3, 4), "b": torch.randn(3)},
          "optimizer": {"state": {"1": {"step": torch.tensor(2.0), "exp_avg": torch.randn(3)}},
                        "param_groups": LOCAL["optimizer"]["param_groups"]},
          "counters": {"step": 7, "seen": {"a": 3}}, "rng": [3, [5, 6], 0.5]}
MANIFEST, DATA = encode(1, SOURCE, chunk_bytes=16)
EXPECTED = expect(LOCAL)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
shapes = st.lists(st.integers(-2, 2**62), max_size=6) | st.lists(st.just(1), min_size=60, max_size=80)


@st.composite
def hostile_manifests(draw: st.DrawFn) -> bytes:
    doc = json.loads(MANIFEST)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "tensor", "shape", "rename", "deep"]))
        if kind == "field":
            doc[draw(st.sampled_from(["format", "step", "tree", "chunk_bytes", "tensors"]))] = draw(json_values)
        elif kind in ("tensor", "shape") and isinstance(doc.get("tensors"), list) and doc["tensors"]:
            spec = doc["tensors"][draw(st.integers(0, len(doc["tensors"]) - 1))]
            if isinstance(spec, dict) and kind == "shape":
                spec["shape"] = draw(shapes)
                spec["nbytes"] = draw(st.integers(-1, 2**70) | st.just(0))
            elif isinstance(spec, dict):
                spec[draw(st.sampled_from(["dtype", "shape", "nbytes", "xxh3"]))] = draw(json_values)
        elif kind == "rename" and isinstance(doc.get("tree"), dict) and doc["tree"]:
            key = draw(st.sampled_from(sorted(doc["tree"])))
            doc["tree"][draw(st.text(min_size=1, max_size=20))] = doc["tree"].pop(key)
        elif kind == "deep":
            tree: object = doc.get("tree")
            for _ in range(draw(st.integers(1, 200))):
                tree = {draw(st.text(max_size=3)): tree}
            doc["tree"] = tree
    return json.dumps(doc).encode()


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A whole HTTP answer: a hostile manifest framed honestly or not, random bytes, or a garbled head."""
    kind = draw(st.sampled_from(["manifest", "framing", "bytes", "head"]))
    if kind == "manifest":
        return http_200(body(draw(hostile_manifests()), DATA))
    if kind == "framing":
        payload = body(MANIFEST, DATA)
        prefix = wire.LENGTH.pack(draw(st.integers(0, 2**64 - 1)))
        payload = draw(st.sampled_from([payload, prefix + payload[wire.LENGTH.size:]]))
        cut = draw(st.integers(0, len(payload)))
        return http_200(payload[:cut], draw(st.none() | st.integers(0, 2**70)))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    # Digits as Latin-1 has them (superscripts are digits to str.isdigit), an error body nested thousands deep.
    numbers = st.text(alphabet="0123456789\u00b2\u00b3\u00b9 -+x", max_size=6)
    status, length = draw(numbers), draw(st.none() | numbers)
    error = draw(st.binary(max_size=100) | st.integers(1, 40_000).map(lambda n: b"[" * n))
    head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(error) if length is None else length}\r\n"
    return head.encode("latin-1") + draw(st.binary(max_size=60)) + b"\r\n\r\n" + error


@pytest.fixture(scope="module")
def answering() -> Iterator[tuple[str, list[bytes]]]:
    """A server on 127.0.0.1 answering every request with ``answer[0]``, then closing the connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    answer = [b""]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the module's tests are over
            with conn, suppress(OSError):
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                    head += chunk
                conn.sendall(answer[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", answer
    finally:
        # A close alone leaves the thread blocked in accept(); shutting the listener down wakes it.
        with suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=5)
        assert not thread.is_alive(), "the answering server's thread did not end"


def fetch_only_state_or_error(address: str) -> None:
    with suppress(StateFetchError):
        tree = fetch_state(address, 1, token=None, timeout_s=5, expected=EXPECTED)
        assert tree.keys() == LOCAL.keys()  # a fetch that succeeds delivers a state shaped like ours


def test_the_honest_answer_is_accepted(answering: tuple[str, list[bytes]]) -> None:
    address, answer = answering
    answer[0] = http_200(body(MANIFEST, DATA))
    got = fetch_state(address, 1, token=None, timeout_s=5, expected=EXPECTED)
    assert torch.equal(got["model"]["w"], SOURCE["model"]["w"])  # type: ignore[index]


@FUZZ
@given(payload=payloads())
def test_only_state_fetch_error_escapes_whatever_the_server_sends(answering: tuple[str, list[bytes]],
                                                                 payload: bytes) -> None:
    address, answer = answering
    answer[0] = payload
    fetch_only_state_or_error(address)


# Host names without dots and over 63 characters: refused by the IDNA codec before any name lookup, so no example
# waits on a resolver.
_hosts = st.text(min_size=64, max_size=80).filter(lambda h: not set(h) & set("./:@?#[]\\"))


@FUZZ
@given(address=st.text(max_size=40) | st.builds(lambda h, p: f"http://{h}:{p}", _hosts, st.integers(-5, 70000))
       | st.builds(lambda s: f"http://127.0.0.1:{s}", st.text(max_size=8)))
def test_only_state_fetch_error_escapes_whatever_address_a_peer_announces(address: str) -> None:
    fetch_only_state_or_error(address)
