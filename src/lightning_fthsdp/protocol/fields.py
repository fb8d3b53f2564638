"""The checks every request body's parser (``protocol.requests``) shares: a field of the right type, the ids that name
who speaks (replica id, incarnation, rank), the form of a state server's address, and the one error a body that fails
any of them raises (``BadBody``)."""

from __future__ import annotations

import re
from types import UnionType
from typing import Any
from urllib.parse import urlsplit

from lightning_fthsdp.protocol.quorum import check_replica_id

INCARNATION_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MISSING = object()


class BadBody(ValueError):
    """A request body the lighthouse refuses, before it changes any state. The message names the field, the value
    and the fix; the lighthouse answers it 400 with that message (``lighthouse.messages.Request.parsed``)."""


def require(body: dict[str, object], name: str, kind: type | UnionType, what: str) -> Any:
    """``body[name]`` if it is a ``kind`` (bool is no int), else BadBody naming the field and value."""
    value = body.get(name, _MISSING)
    if type(value) is kind:  # what JSON decodes to: the lighthouse checks a dozen fields per request this way
        return value
    if value is _MISSING:
        raise BadBody(f"missing field {name!r}: send it as {what}")
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise BadBody(f"field {name!r} must be {what}, got {value!r}")
    return value


def require_int(body: dict[str, object], name: str, minimum: int | None) -> int:
    """``body[name]`` if it is an int >= ``minimum`` (None: any), else BadBody."""
    value = body.get(name, _MISSING)
    if type(value) is int and (minimum is None or value >= minimum):  # the words of a refusal only for one
        return value
    what = "an integer" if minimum is None else f"an integer >= {minimum}"
    value = require(body, name, int, what)
    if minimum is not None and value < minimum:
        raise BadBody(f"field {name!r} must be {what}, got {value!r}")
    return value


def check_incarnation(incarnation: object) -> str:
    """Return ``incarnation`` if it is a valid incarnation id (1-64 of letters, digits, ``_-``), else ValueError."""
    if not isinstance(incarnation, str) or not INCARNATION_PATTERN.match(incarnation):
        raise ValueError(f"incarnation must be 1-64 characters of letters, digits, '_' or '-', got {incarnation!r}")
    return incarnation


def state_server_location(address: str) -> tuple[str, int] | None:
    """``address``'s host and port if it is a state server's address as ranks advertise it, ``http://HOST:PORT``
    (nothing more: no path, query, fragment or user), else None. The lighthouse refuses any other in a quorum request
    and a catching-up rank refuses to fetch from one: an address that is none would only fail at the fetch."""
    try:
        parts = urlsplit(address)
        if (parts.scheme == "http" and parts.hostname and parts.port is not None
                and not (parts.path or parts.query or parts.fragment or parts.username)):
            return parts.hostname, parts.port
    except ValueError:  # urlsplit's own refusals (an unclosed '['), and a port out of range
        pass
    return None


def replica_id_field(body: dict[str, object]) -> str:
    """Field ``replica_id``: the group that speaks."""
    value = require(body, "replica_id", str, "a replica id string")
    try:
        return check_replica_id(value)
    except ValueError as e:
        raise BadBody(f"field 'replica_id': {e}") from None


def incarnation_field(body: dict[str, object]) -> str:
    """Field ``incarnation``: the start of the group's processes that speaks (``lighthouse.registry``)."""
    value = require(body, "incarnation", str, "the incarnation id the group's leader chose")
    try:
        return check_incarnation(value)
    except ValueError as e:
        raise BadBody(f"field 'incarnation': {e}") from None


def rank_field(body: dict[str, object]) -> int:
    """Field ``rank``: the rank inside the replica group (0, the leader, when not sent)."""
    return require_int(body, "rank", 0) if "rank" in body else 0


def replica_ids_field(body: dict[str, object], name: str, what: str) -> tuple[str, ...]:
    """Field ``name``: a list of valid replica ids (BadBody naming the field and the first invalid entry)."""
    ids = require(body, name, list, what)
    for rid in ids:
        try:
            check_replica_id(rid)
        except ValueError as e:
            raise BadBody(f"field {name!r} has an invalid entry: {e}") from None
    return tuple(ids)
