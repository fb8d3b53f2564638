"""What the lighthouse shows, read only: the status page (``GET /``), ``GET /status`` (``status_view``), ``GET /events``
(the event log and membership history, ``watch``; ``?after=SEQ`` for the newer events only) and ``GET /metrics``
(Prometheus text, ``metrics``).

The page is one static HTML file whose script polls ``/status`` and ``/events`` and updates the page in place (no
reload, no CDN, every value set as text). It is the same bytes for everyone, read once at import: it carries no data.
Like every path it needs the token (a browser asks for it: HTTP Basic, the token as the password), and the browser
sends the same credentials with the page's polls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from lightning_fthsdp.lighthouse.messages import Handler, HttpError, Request, Response, json_response
from lightning_fthsdp.lighthouse.watch import Watch

if TYPE_CHECKING:  # prometheus_client is imported when the lighthouse is made (see metrics_of)
    from lightning_fthsdp.lighthouse.metrics import LighthouseMetrics

log = logging.getLogger("fthsdp.lighthouse")

PAGE: bytes = files(__package__).joinpath("dashboard.html").read_bytes()


def view_routes(watch: Watch, status: Callable[[], dict[str, object]]) -> dict[str, tuple[str, Handler]]:
    """The read-only routes over ``watch`` and the ``status()`` document."""
    def status_route(request: Request) -> Response:
        return json_response(status())

    def events(request: Request) -> Response:
        after = request.query.get("after", "0")
        if not (after.isascii() and after.isdigit() and len(after) <= 18):
            raise HttpError(400, f"query parameter 'after' must be an event number >= 0, got {after!r}")
        return json_response(watch.to_json(int(after)))

    def metrics(request: Request) -> Response:
        if watch.metrics is None:
            raise HttpError(501, "GET /metrics needs the prometheus_client package, a dependency of "
                                 "lightning-fthsdp: reinstall it (pip install lightning-fthsdp) or pip install "
                                 "prometheus_client, then restart the lighthouse")
        return Response(200, watch.metrics.render(), watch.metrics.content_type)

    def page(request: Request) -> Response:
        return Response(200, PAGE, "text/html; charset=utf-8")

    return {"/status": ("GET", status_route), "/events": ("GET", events), "/metrics": ("GET", metrics),
            "/": ("GET", page)}


def metrics_of(status: Callable[[], dict[str, Any]]) -> LighthouseMetrics | None:
    """The lighthouse's Prometheus metrics, or None when ``prometheus_client`` is missing (an install older than the
    dependency): the lighthouse runs on and ``GET /metrics`` says what to install."""
    try:
        from lightning_fthsdp.lighthouse.metrics import LighthouseMetrics
    except ImportError:
        log.warning("prometheus_client is not installed: GET /metrics answers 501 (pip install prometheus_client)")
        return None
    return LighthouseMetrics(status)
