"""The ranks' side of the control plane, in the training processes: the leader's heartbeats and quorum requests
(``client``) over its one connection to the lighthouse (``connection``), what a rank knows of the membership and its
commit lease (``view``), the leader's relay to its group's other ranks (``relay``) and their side of it (``member``).
It shares only the wire types (``lightning_fthsdp.protocol``) with the lighthouse service."""
