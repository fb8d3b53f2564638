"""Recovery: catch-up of a restarted replica group by state transfer from a healthy peer.

A healthy group takes a CPU :func:`~lightning_fthsdp.recovery.snapshot.snapshot` of its state at a step boundary and
publishes it on a :class:`~lightning_fthsdp.recovery.server.StateServer`; the catching-up group pulls it with
:func:`~lightning_fthsdp.recovery.client.fetch_state` while both take part in the same step. The wire format
(:mod:`~lightning_fthsdp.recovery.wire`) is a JSON manifest plus raw tensor bytes, each chunk checked by an XXH3-64
digest: nothing received is ever unpickled or executed.
"""
