"""The lighthouse API at its edge, what of it is the service's own: the token check, the shard count a group must
share with the job, and the encoded answers (the quorum's, shared by its members; the probe and exclusion answers
wrapped from ``protocol.answers``). The request bodies are ``protocol.requests``'.

Every check raises :class:`~lightning_fthsdp.lighthouse.messages.HttpError` naming the value and the fix, and runs
before the server changes any state, so a rejected request leaves the lighthouse as it was.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hmac
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping

from lightning_fthsdp.lighthouse.exclusions import Exclusion
from lightning_fthsdp.lighthouse.messages import HttpError, Request, Response, json_response
from lightning_fthsdp.protocol.answers import excluded_answer_body, probe_answer_body
from lightning_fthsdp.protocol.quorum import Quorum, QuorumRequest

GZIP_OVER_BYTES = 16384
"""Quorum answers larger than this are also sent gzip-compressed to clients that accept it."""
KEPT_BASES = 8
"""Member lists kept as bases of delta answers: the newest answered. A steady group holds the newest one; after a few
changes in a row, or an answer lost on its way, an older one."""


def authorize(request: Request, token: bytes | None) -> None:
    """Refuse (401) a request without the lighthouse's token, when it has one.

    The token travels only in the ``Authorization`` header: ``Bearer TOKEN`` for programs, or HTTP Basic with the
    token as the password (any user name) for a browser, which prompts for it on the 401's ``WWW-Authenticate``.
    A token in the URL is refused even when the header is right: URLs end up in proxy and access logs.
    """
    if token is None:
        return
    if "token" in request.query:
        raise HttpError(401, "a token in the URL (?token=) is refused because URLs are logged: send it in the "
                             "'Authorization: Bearer TOKEN' header (a browser: the password of the login prompt)",
                        _CHALLENGE)
    given = _header_token(request.headers.get("authorization", ""))
    if not hmac.compare_digest(given, token):
        what = "a wrong token" if given else "no token"
        raise HttpError(401, f"request has {what}: send 'Authorization: Bearer TOKEN' with the lighthouse's token "
                             f"(a browser: the token as the password of the login prompt)", _CHALLENGE)


_CHALLENGE = (("WWW-Authenticate", 'Basic realm="fthsdp lighthouse", charset="UTF-8"'),)
"""Makes a browser prompt for credentials; ``authorize`` takes the password as the token."""


def _header_token(header: str) -> bytes:
    """The token an ``Authorization`` header carries (b"" when none): Bearer, or the password of Basic."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode("latin-1")  # the head was decoded as latin-1: the bytes as sent
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return b""
        return decoded.partition(b":")[2]
    return b""


def check_shard_count(replica_id: str, shard_count: int, configured: int | None, previous: Quorum | None,
                      pending: Mapping[str, QuorumRequest], lives: Callable[[str], bool]) -> None:
    """Refuse (409) a group whose shard count is not the job's: the cross-group process groups pair shard rank s of
    every group. The job's is ``configured`` (``fthsdp lighthouse --shard-count``) when given; else the current
    quorum's while another of its members ``lives``, or else another pending request's: a value only a departed
    group held binds nobody (one forged request must not lock out every group to come)."""
    if configured is not None:
        expected, source = configured, "the job's shard_count (fthsdp lighthouse --shard-count)"
    elif previous is not None and any(rid != replica_id and lives(rid) for rid in previous.member_ids):
        expected, source = previous.shard_count, f"the current quorum {previous.quorum_id}"
    else:
        other = next((r for rid, r in pending.items() if rid != replica_id), None)
        if other is None:
            return
        expected, source = other.shard_count, f"the pending request of {other.replica_id!r}"
    if shard_count != expected:
        raise HttpError(409, f"shard_count {shard_count} of {replica_id!r} differs from shard_count {expected} of "
                             f"{source}: every replica group must use the same number of shard ranks (start it with "
                             f"{expected})")


class QuorumAnswers:
    """The encoded answers of the current quorum: a delta (``Quorum.to_delta_json``) for a requester holding one of
    the last ``KEPT_BASES`` member lists answered, the full quorum for any other.

    A full answer is O(members) bytes and every member asks each step: O(members^2) bytes a step in all. A delta
    carries what changed since the requester's quorum, nothing in the steady state but the fields of the step. Each
    (answer, base) is encoded once, compressed once when large, and the same bytes go to every requester holding
    that base.
    """

    def __init__(self) -> None:
        self._bases: OrderedDict[str, Quorum] = OrderedDict()
        self._current: Quorum | None = None
        self._store = ""
        self._encoded: dict[str, Response] = {}

    def formed(self, quorum: Quorum, store_address: str) -> None:
        """``quorum`` is the answer from now on; its rendezvous store is at ``store_address``."""
        self._current, self._store, self._encoded = quorum, store_address, {}
        self._bases[quorum.members_digest] = quorum
        self._bases.move_to_end(quorum.members_digest)
        if len(self._bases) > KEPT_BASES:
            self._bases.popitem(last=False)

    def base(self, members_digest: str) -> Quorum | None:
        """A kept quorum whose member list ``members_digest`` names (None: not one of those kept)."""
        return self._bases.get(members_digest)

    def to(self, members_digest: str) -> Response:
        """The answer for a requester holding the member list ``members_digest`` names ("": none)."""
        assert self._current is not None, "QuorumAnswers.to follows formed()"
        base = self._bases.get(members_digest)
        key = members_digest if base is not None else ""
        response = self._encoded.get(key)
        if response is None:
            answer = self._current.to_json() if base is None else self._current.to_delta_json(base)
            body = json.dumps({**answer, "store": self._store}, separators=(",", ":")).encode()
            response = Response(200, body, gzipped=gzip.compress(body, 6) if len(body) > GZIP_OVER_BYTES else None)
            self._encoded[key] = response
        return response


def probe_answer(targets: dict[str, str], why: str) -> Response:
    """The answer to a quorum request that must first probe ``targets`` (``protocol.answers.probe_answer_body``)."""
    return json_response(probe_answer_body(targets, why))


def excluded_answer(replica_id: str, exclusion: Exclusion, targets: dict[str, str], now: float) -> Response:
    """The answer to a quorum request of an excluded group (``protocol.answers.excluded_answer_body``)."""
    return json_response(excluded_answer_body(replica_id, exclusion.to_json(now), targets))
