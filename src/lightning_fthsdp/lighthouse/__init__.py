"""The control plane: the lighthouse service (quorum rules, server and its parts, HTTP, page, CLI) and the client
ranks use.

Imports only ``config`` and itself, and importing any of it never imports torch, so the ``fthsdp lighthouse``
command parses its arguments and reports a bad one at once; only a lighthouse that starts imports torch, for the
TCPStore it hosts for the cross-group rendezvous. A lighthouse also imports ``prometheus_client`` when it is made, for
``GET /metrics`` (and runs on without it).
"""
