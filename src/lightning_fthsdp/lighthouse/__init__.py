"""The control plane's service: the lighthouse (quorum rules, server and its parts, HTTP, page, CLI). The ranks' side
is ``lightning_fthsdp.membership``; the two share only the wire types of ``lightning_fthsdp.protocol``.

Imports only ``config``, ``protocol`` and itself, and importing any of it never imports torch, so the ``fthsdp
lighthouse`` command parses its arguments and reports a bad one at once; only a lighthouse that starts imports
torch, for the TCPStore it hosts for the cross-group rendezvous. A lighthouse also imports ``prometheus_client``
when it is made, for ``GET /metrics`` (and runs on without it).
"""
