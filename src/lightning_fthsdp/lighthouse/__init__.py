"""The control plane: the lighthouse service (quorum rules, server, HTTP, page, CLI) and the client ranks use.

Imports only ``config``; a lighthouse process never imports torch.
"""
