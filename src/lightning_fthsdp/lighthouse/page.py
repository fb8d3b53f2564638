"""The lighthouse's human status page (``GET /``): the ``/status`` document as HTML, every value escaped."""

from __future__ import annotations

from html import escape
from typing import Any

_COLUMNS = ("replica_id", "step", "alive", "dead", "heartbeat_age_s", "in_quorum", "pending")


def render(status: dict[str, Any]) -> str:
    """An HTML page of ``Lighthouse.status()``; refreshes itself every 2 s."""
    summary = "".join(
        f"<tr><th>{escape(key)}</th><td>{escape(str(status[key]))}</td></tr>"
        for key in ("quorum_id", "epoch", "max_step", "min_replicas", "store", "uptime_s")
    )
    members = escape(", ".join(status["members"])) or "(none)"
    head = "".join(f"<th>{escape(c)}</th>" for c in _COLUMNS)
    rows = "".join(
        "<tr>" + "".join(f"<td>{escape(str(r[c]))}</td>" for c in _COLUMNS) + "</tr>" for r in status["groups"]
    )
    catch_ups = "".join(
        f"<li>{escape(r['replica_id'])} &larr; {escape(r['source'])}</li>" for r in status["catch_up_from"]
    ) or "<li>(none)</li>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='2'>"
        "<title>fthsdp lighthouse</title></head><body><h1>fthsdp lighthouse</h1>"
        f"<table>{summary}</table><h2>Quorum members</h2><p>{members}</p>"
        f"<h2>Replica groups</h2><table><tr>{head}</tr>{rows}</table>"
        f"<h2>Catching up from</h2><ul>{catch_ups}</ul></body></html>"
    )
