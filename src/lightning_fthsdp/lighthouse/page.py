"""The lighthouse's status page (``GET /``): one static HTML file whose script polls ``/status`` and ``/events`` and
updates the page in place (no reload, no CDN, every value set as text).

The page is the same bytes for everyone, read once: it carries no data, so the token guards the data, not the page's
markup, and a browser that logged in for the page sends the same credentials with its polls.
"""

from __future__ import annotations

from importlib.resources import files

PAGE: bytes = files(__package__).joinpath("dashboard.html").read_bytes()
