"""The lighthouse's status page (``GET /``): one static HTML file whose script polls ``/status`` and ``/events`` and
updates the page in place (no reload, no CDN, every value set as text).

The page is the same bytes for everyone, read once at import: it carries no data. Like every path it needs the token
(a browser asks for it: HTTP Basic, the token as the password), and the browser sends the same credentials with the
page's polls.
"""

from __future__ import annotations

from importlib.resources import files

PAGE: bytes = files(__package__).joinpath("dashboard.html").read_bytes()
