"""State transfer transport: snapshot, StateServer and fetch_state against real servers on 127.0.0.1 port 0.

Misbehaving servers (corrupting, truncating, stalling, sending pickles or bad manifests) are small raw-socket fakes,
so the client is tested against exactly the bytes it must refuse.
"""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fthsdp.recovery import wire
from lightning_fthsdp.recovery.client import StateFetchError, fetch_state
from lightning_fthsdp.recovery.server import StateServer
from lightning_fthsdp.recovery.snapshot import reserve, snapshot, unshared

TOKEN = "s3cret"


@pytest.fixture
def server() -> Iterator[StateServer]:
    srv = StateServer(token=TOKEN, chunk_bytes=1024)
    try:
        yield srv
    finally:
        srv.close()


def sample_tree() -> dict[str, object]:
    return {
        "model": {"w": torch.randn(40, 33), "b": torch.arange(7, dtype=torch.bfloat16)},
        "optimizer": {"state": {"0": {"exp_avg": torch.randn(3000), "step": torch.tensor(5)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "name": None, "fused": False}]},
        "counters": {"ids": torch.arange(10, dtype=torch.int64), "mask": torch.tensor([True, False, True])},
        "empty": torch.empty(0, 4),
        "rng": torch.get_rng_state(),
        "meta": ["text", 3, 2.5, None, True, {"nested": [1, [2, 3]]}],
    }


def assert_same(got: object, want: object) -> None:
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want)  # tuples travel as lists
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert type(got) is type(want) and got == want


def encode(step: int, tree: dict[str, object], chunk_bytes: int) -> tuple[bytes, bytes]:
    """(manifest, tensor bytes) exactly as a StateServer would send them."""
    skeleton, tensors = wire.split_tree(tree)
    views = [wire.byte_view(t) for t in tensors]
    digests = wire.chunk_digests(views, chunk_bytes, 1)
    return wire.build_manifest(step, skeleton, tensors, digests, chunk_bytes), b"".join(bytes(v) for v in views)


def body(manifest: bytes, data: bytes) -> bytes:
    return wire.LENGTH.pack(len(manifest)) + manifest + data


def http_200(payload: bytes, length: int | None = None) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload) if length is None else length}\r\n\r\n"
    return head.encode() + payload


def sending(response: bytes) -> Callable[[socket.socket], None]:
    return lambda conn: conn.sendall(response)


@contextmanager
def fake_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A one-request HTTP server on port 0 that reads the request head and lets ``answer`` write anything."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed before the client came
        with conn:
            conn.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            with suppress(OSError):  # the client hung up first, as an aborting client should
                answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(timeout=5)


def fetch(address: str, step: int = 1, **kwargs: object) -> object:
    kwargs.setdefault("token", TOKEN)
    kwargs.setdefault("timeout_s", 5.0)
    return fetch_state(address, step, **kwargs)  # type: ignore[arg-type]


# --- round trip and snapshot ---------------------------------------------------------------------------------------


def test_round_trip_nested_tree_many_dtypes_and_chunks(server: StateServer) -> None:
    tree = sample_tree()
    server.publish(server.prepare(3, snapshot(tree)))
    got = fetch(server.address, 3)
    assert_same(got, tree)
    assert got["optimizer"]["state"]["0"]["exp_avg"].is_contiguous()  # type: ignore[index]


def test_round_trip_without_token_and_default_chunks() -> None:
    srv = StateServer()
    try:
        srv.publish(srv.prepare(0, snapshot({"x": torch.ones(5)})))
        assert torch.equal(fetch(srv.address, 0, token=None)["x"], torch.ones(5))  # type: ignore[index]
    finally:
        srv.close()


def test_snapshot_copies_views_exactly() -> None:
    base = torch.arange(40, dtype=torch.bfloat16)
    negated = torch._neg_view(torch.tensor([1.0, -2.0]))  # contiguous, its values negated by a bit, not in memory
    assert negated.is_neg() and negated.is_contiguous()
    live = {"offset": base[7:19], "strided": base.view(8, 5).t(), "empty": base[:0], "int": torch.arange(5)[1:],
            "negated": negated}
    snap = snapshot(live)
    for name, t in live.items():
        assert torch.equal(snap[name], t) and snap[name].dtype == t.dtype and snap[name].is_contiguous(), name  # type: ignore[arg-type,union-attr]
    assert snap["offset"].data_ptr() != base.data_ptr() + 7 * base.element_size()  # type: ignore[union-attr]


def test_snapshot_does_not_alias_the_live_tensors() -> None:
    live = {"w": torch.zeros(4, 4).t(), "p": torch.nn.Parameter(torch.ones(3))}  # non-contiguous, requires_grad
    snap = snapshot(live)
    with torch.no_grad():
        live["w"].add_(1)
        live["p"].mul_(7)
    assert torch.equal(snap["w"], torch.zeros(4, 4)) and torch.equal(snap["p"], torch.ones(3))  # type: ignore[arg-type]
    assert snap["w"].is_contiguous() and type(snap["p"]) is torch.Tensor and not snap["p"].requires_grad  # type: ignore[union-attr]


def test_snapshot_into_an_earlier_one_reuses_its_memory_where_path_shape_and_dtype_match() -> None:
    earlier = snapshot({"w": torch.zeros(4, 4), "b": torch.zeros(3), "n": torch.zeros(2), "a.b": torch.zeros(1),
                        "a": {"b": torch.zeros(1)}})
    live = {"w": torch.randn(4, 4).t(), "b": torch.randn(5), "n": torch.ones(2, dtype=torch.int64),
            "a.b": torch.ones(1), "a": {"b": torch.ones(1)}, "new": torch.ones(2)}
    snap = snapshot(live, into=earlier)
    assert snap["w"].data_ptr() == earlier["w"].data_ptr() and torch.equal(snap["w"], live["w"])  # type: ignore[union-attr,index,arg-type]
    for name in ("b", "n", "a.b"):  # another shape, another dtype, a path two leaves share: fresh memory
        assert snap[name].data_ptr() != earlier[name].data_ptr()  # type: ignore[union-attr,index]
        assert torch.equal(snap[name], live[name])  # type: ignore[arg-type]
    assert snap["a"]["b"].data_ptr() != snap["a.b"].data_ptr()  # type: ignore[index,union-attr]
    with torch.no_grad():
        live["w"].add_(1)
    assert not torch.equal(snap["w"], live["w"])  # type: ignore[arg-type]


def test_reserved_memory_has_the_snapshot_layout_and_the_first_snapshot_copies_into_it() -> None:
    live = {"w": torch.randn(4, 4), "opt": [torch.ones(3, dtype=torch.int64)], "step": 5}
    spare = reserve(live)
    assert spare["step"] == 5 and torch.equal(spare["w"], torch.zeros(4, 4))  # type: ignore[arg-type]
    assert spare["opt"][0].dtype == torch.int64 and spare["opt"][0].shape == (3,)  # type: ignore[index,union-attr]
    snap = snapshot(live, into=spare)
    assert snap["w"].data_ptr() == spare["w"].data_ptr() and torch.equal(snap["w"], live["w"])  # type: ignore[union-attr,index,arg-type]


def test_reserve_into_keeps_what_fits_and_maps_the_rest() -> None:
    live = {"w": torch.randn(4, 4), "b": torch.randn(3), "n": torch.arange(2)}
    have = {"w": torch.full((4, 4), 7.0), "b": torch.ones(5), "n": None}  # b: another shape; n: adopted (None)
    spare = reserve(live, into=have)
    assert spare["w"] is have["w"] and torch.equal(spare["w"], torch.full((4, 4), 7.0))  # reused, not cleared
    assert spare["b"].shape == (3,) and spare["n"].dtype == torch.int64 and spare["n"].shape == (2,)  # type: ignore[union-attr]
    other = reserve(live, into={"w": torch.zeros(4, 4, dtype=torch.float64), "b": torch.zeros(6)[::2]})
    assert other["w"].dtype == torch.float32 and other["b"].is_contiguous()  # another dtype, a strided view: fresh  # type: ignore[union-attr]


def test_unshared_drops_the_tensors_a_loader_adopted() -> None:
    block = torch.zeros(16)
    fetched = {"copied": torch.ones(4), "adopted": torch.arange(6.0), "viewed": torch.zeros(8), "step": 3,
               "inside": block}
    live = {"p": torch.zeros(4), "q": fetched["adopted"], "r": fetched["viewed"][2:6],  # adopted whole, and a view
            "s": torch.from_numpy(block.numpy()[4:])}  # another storage object inside the fetched block
    kept = unshared(fetched, live)
    assert kept["copied"] is fetched["copied"] and kept["step"] == 3
    assert kept["adopted"] is None and kept["viewed"] is None and kept["inside"] is None


def test_a_replaced_snapshot_is_released_once_no_transfer_reads_it() -> None:
    released: list[wire.StateTree] = []
    srv = StateServer(chunk_bytes=1 << 10, on_released=released.append)
    try:
        first = snapshot({"a": torch.randn(1000)})
        srv.publish(srv.prepare(1, first))
        srv.publish(srv.prepare(2, snapshot({"a": torch.randn(1 << 20)})))  # 4 MiB in 4096 chunks
        assert len(released) == 1 and released[0]["a"] is first["a"]  # type: ignore[index]
        errors: list[BaseException | None] = []
        fetcher = threading.Thread(target=lambda: errors.append(_fetch_error(srv.address, 2)))
        fetcher.start()
        srv.withdraw()  # during the transfer, or before it: released once, after its last reader
        fetcher.join(timeout=10)
        assert not fetcher.is_alive() and len(released) == 2 and released[1]["a"].numel() == 1 << 20  # type: ignore[index,union-attr]
        # Finished before the withdraw, cut off by it, or refused after it: never a corrupt or mixed payload.
        assert errors == [None] or any(s in str(errors[0]) for s in ("truncated", "404")), errors
    finally:
        srv.close()


def test_snapshot_refuses_unsupported_leaves_naming_the_path() -> None:
    with pytest.raises(TypeError, match=r"'optimizer\.state\.0\.exp_avg'.*set"):
        snapshot({"optimizer": {"state": {"0": {"exp_avg": {1, 2}}}}})
    with pytest.raises(TypeError, match=r"'x\.1'.*complex64"):
        snapshot({"x": [torch.ones(1), torch.ones(1, dtype=torch.complex64)]})
    with pytest.raises(TypeError, match="key 3"):
        snapshot({"x": {3: 1}})
    with pytest.raises(ValueError, match=r"'__tensor__' at 'a' is reserved"):
        snapshot({"a": {"__tensor__": 0}})


def test_prepare_refuses_what_is_not_a_snapshot(server: StateServer) -> None:
    with pytest.raises(ValueError, match=r"'w'.*not a snapshot"):
        server.prepare(1, {"w": torch.zeros(3, 3).t()})
    with pytest.raises(ValueError, match="reserved"):
        server.prepare(1, {"__tensor__": 1})
    with pytest.raises(ValueError, match="step >= 0"):
        server.prepare(-1, {})


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("gloo_group")
def test_snapshot_takes_the_local_shard_of_a_dtensor() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(12.0).reshape(4, 3)
    dtensor = distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)])
    snap = snapshot({"w": dtensor})
    assert type(snap["w"]) is torch.Tensor and torch.equal(snap["w"], dtensor.to_local())  # type: ignore[arg-type]
    with torch.no_grad():
        dtensor.to_local().add_(1)
    assert torch.equal(snap["w"], full)  # type: ignore[arg-type]


# --- waiting for a step --------------------------------------------------------------------------------------------


def test_fetch_started_before_publish_gets_the_step_once_published(server: StateServer) -> None:
    tree = {"w": torch.randn(100)}
    prepared = server.prepare(7, snapshot(tree))
    publisher = threading.Timer(0.3, server.publish, args=(prepared,))  # the delay only orders the events
    publisher.start()
    try:
        assert_same(fetch(server.address, 7, timeout_s=10.0), tree)
    finally:
        publisher.cancel()


def test_fetch_of_a_step_never_published_fails_after_about_the_timeout(server: StateServer) -> None:
    server.publish(server.prepare(1, {"w": torch.ones(1)}))
    start = time.monotonic()
    with pytest.raises(StateFetchError, match=r"404.*step 2.*holds step 1"):
        fetch(server.address, 2, timeout_s=1.0)
    assert 0.7 < time.monotonic() - start < 1.5


def test_fetch_of_an_older_step_gets_410(server: StateServer) -> None:
    server.publish(server.prepare(5, {"w": torch.ones(1)}))
    with pytest.raises(StateFetchError, match=r"410.*holds step 5"):
        fetch(server.address, 4)


def test_withdrawn_snapshot_is_404_after_the_wait(server: StateServer) -> None:
    server.publish(server.prepare(2, {"w": torch.ones(1)}))
    server.withdraw()
    start = time.monotonic()
    with pytest.raises(StateFetchError, match=r"404.*holds no snapshot"):
        fetch(server.address, 2, timeout_s=0.6)
    assert time.monotonic() - start > 0.4


def test_withdraw_unless_read_keeps_the_snapshot_while_a_request_wants_it(server: StateServer) -> None:
    """A recovering group that follows the job fetches across steps: the source's per-step withdraw must not cut
    it off, even when the request came before the publish; once nobody wants it, it goes."""
    tree = {"w": torch.randn(1000)}

    def publish_then_withdraw() -> None:
        server.publish(server.prepare(3, snapshot(tree)))
        server.withdraw(unless_read=True)

    publisher = threading.Timer(0.3, publish_then_withdraw)  # the delay only orders the events
    publisher.start()
    try:
        assert_same(fetch(server.address, 3, timeout_s=10.0), tree)
    finally:
        publisher.cancel()
    server.withdraw(unless_read=True)
    with pytest.raises(StateFetchError, match=r"404.*holds no snapshot"):
        fetch(server.address, 3, timeout_s=0.3)


def test_abort_while_waiting_for_publish_returns_promptly(server: StateServer) -> None:
    abort = threading.Event()
    threading.Timer(0.2, abort.set).start()
    start = time.monotonic()
    with pytest.raises(StateFetchError, match="aborted"):
        fetch(server.address, 1, timeout_s=10.0, abort=abort)
    assert time.monotonic() - start < 1.0


# --- authentication and reachability -------------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["wrong", None])
def test_wrong_or_missing_token_is_401(server: StateServer, token: str | None) -> None:
    server.publish(server.prepare(1, {"w": torch.ones(1)}))
    with pytest.raises(StateFetchError, match="401"):
        fetch(server.address, 1, token=token)


def test_unreachable_server() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed on exit: nothing listens there any more
    with pytest.raises(StateFetchError, match="unreachable"):
        fetch(f"http://127.0.0.1:{port}", timeout_s=2.0)


# --- hostile or broken servers ------------------------------------------------------------------------------------


def test_corrupted_chunk_names_tensor_and_chunk_and_returns_nothing() -> None:
    manifest, data = encode(1, {"a": torch.zeros(10), "b": torch.randn(1000)}, chunk_bytes=1024)
    corrupt = bytearray(data)
    corrupt[40 + 2 * 1024 + 5] ^= 0xFF  # tensor 1 starts after tensor 0's 40 bytes; byte 5 of its chunk 2
    with (fake_server(sending(http_200(body(manifest, bytes(corrupt))))) as address,
          pytest.raises(StateFetchError, match=r"digest mismatch in tensor 1 \(b\) chunk 2")):
        fetch(address)


def test_truncated_payload() -> None:
    manifest, data = encode(1, {"a": torch.randn(5000)}, chunk_bytes=1024)
    payload = body(manifest, data)
    with (fake_server(sending(http_200(payload[: len(payload) // 2], len(payload)))) as address,
          pytest.raises(StateFetchError, match="truncated payload")):
        fetch(address)


class _Touch:
    """Unpickling this creates ``path``: the proof a client executed what it received."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("framed", [False, True])
def test_pickle_payload_is_refused_without_executing_it(tmp_path: Path, framed: bool) -> None:
    marker = tmp_path / "executed"
    evil = pickle.dumps(_Touch(marker))
    # framed: a plausible manifest length in front, so the pickle reaches the manifest parser.
    payload = wire.LENGTH.pack(len(evil)) + evil if framed else evil
    with fake_server(sending(http_200(payload))) as address, pytest.raises(StateFetchError, match="malformed"):
        fetch(address)
    assert not marker.exists()


def _tampered(edit: Callable[[dict[str, object]], None]) -> bytes:
    manifest, data = encode(1, {"a": torch.ones(100)}, chunk_bytes=1024)
    doc = json.loads(manifest)
    edit(doc)
    return body(json.dumps(doc).encode(), data)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["tensors"][0].update(dtype="complex64"), "unsupported dtype 'complex64'"),
    (lambda m: m["tensors"][0].update(dtype="object"), "unsupported dtype 'object'"),
    (lambda m: m["tensors"][0].update(nbytes=4000), r"nbytes 4000 != numel \* itemsize = 400"),
    (lambda m: m["tensors"][0].update(shape=[-100, -1]), "non-negative"),
    (lambda m: m["tensors"][0].update(xxh3=[]), "needs ceil"),
    (lambda m: m.update(format="fthsdp-state/2"), "unsupported manifest format"),
    (lambda m: m.update(step=2), "for step 2"),
    (lambda m: m.update(tree={"a": {"__tensor__": 0}, "b": {"__tensor__": 0}}), "repeated tensor placeholder"),
    (lambda m: m.update(tree={}), "referencing every tensor"),
    (lambda m: m["tensors"][0].update(shape=[100] + [1] * 69_999), "70000 dimensions, over 64"),
    (lambda m: m.update(tree=_nested({"a": {"__tensor__": 0}}, 100)), "nested deeper than 64 levels"),
])
def test_bad_manifest_is_refused_before_allocation(monkeypatch: pytest.MonkeyPatch, edit: Callable[..., None],
                                                   message: str) -> None:
    payload = _tampered(edit)

    def no_allocation(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("allocated a tensor for a manifest that should have been refused")

    with fake_server(sending(http_200(payload))) as address, pytest.raises(StateFetchError, match=message):
        monkeypatch.setattr(torch, "empty", no_allocation)
        fetch(address)


def _nested(leaf: dict[str, object], depth: int) -> dict[str, object]:
    for _ in range(depth):
        leaf = {"x": leaf}
    return leaf


@pytest.mark.parametrize("address", ["not-a-url", "http://127.0.0.1:99999", "ftp://127.0.0.1:1", "http://:80"])
def test_a_malformed_peer_address_is_a_fetch_error(address: str) -> None:
    with pytest.raises(StateFetchError, match="refused the state server address"):
        fetch(address)


def test_a_state_the_host_cannot_allocate_is_a_fetch_error(monkeypatch: pytest.MonkeyPatch) -> None:
    manifest, data = encode(1, {"a": torch.ones(100)}, chunk_bytes=1024)

    def out_of_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("can't allocate memory")

    with fake_server(sending(http_200(body(manifest, data)))) as address, pytest.raises(
            StateFetchError, match=r"allocating its 400 bytes failed \(can't allocate memory\)"):
        monkeypatch.setattr(torch, "empty", out_of_memory)
        fetch(address)


def test_limits_exceeded(server: StateServer) -> None:
    server.publish(server.prepare(1, {"a": torch.ones(1000)}))
    with pytest.raises(StateFetchError, match=r"limits exceeded.*4000 bytes.*max_bytes=1000"):
        fetch(server.address, 1, max_bytes=1000)


def test_abort_during_a_slow_transfer_returns_promptly() -> None:
    manifest, data = encode(1, {"a": torch.randn(100_000)}, chunk_bytes=1024)
    payload = body(manifest, data)
    release = threading.Event()

    def stall(conn: socket.socket) -> None:
        conn.sendall(http_200(payload[: len(payload) // 3], len(payload)))
        release.wait(10)  # the server stalls mid-body; bounded so the fake always ends

    abort = threading.Event()
    try:
        with fake_server(stall) as address:
            threading.Timer(0.3, abort.set).start()
            start = time.monotonic()
            with pytest.raises(StateFetchError, match="aborted while receiving tensor 0"):
                fetch(address, timeout_s=10.0, abort=abort)
            assert time.monotonic() - start < 1.0
            release.set()
    finally:
        release.set()


def test_replacing_the_snapshot_cuts_off_a_transfer_in_flight() -> None:
    srv = StateServer(chunk_bytes=1 << 10)
    try:
        srv.publish(srv.prepare(1, {"a": torch.randn(1 << 20)}))  # 4 MiB in 4096 chunks
        errors: list[BaseException] = []
        fetcher = threading.Thread(target=lambda: errors.append(_fetch_error(srv.address, 1)))
        fetcher.start()
        srv.publish(srv.prepare(2, {"a": torch.ones(1)}))
        fetcher.join(timeout=10)
        # Either the fetch finished before the replace, or it was cut off (or answered 410): never hung, never mixed.
        assert not fetcher.is_alive() and (errors == [None] or "truncated" in str(errors[0])
                                           or "410" in str(errors[0]))
    finally:
        srv.close()


def _fetch_error(address: str, step: int) -> BaseException | None:
    try:
        fetch(address, step, token=None)
    except StateFetchError as e:
        return e
    return None


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["format", "step", "tree", "chunk_bytes", "tensors", "dtype", "shape", "nbytes", "xxh3",
                         "__tensor__"]), inner, max_size=5),
    max_leaves=20,
).map(lambda doc: json.dumps(doc).encode())))
def test_parse_manifest_only_ever_raises_manifest_error(raw: bytes) -> None:
    with suppress(wire.ManifestError):
        wire.parse_manifest(raw, 1, 1 << 30)
