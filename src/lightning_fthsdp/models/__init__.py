"""Models and data modules the recipes train: a decoder-only LM on stdlib text, an MLP regressor on generated data.

Imports Lightning and torch; only the group processes (``fthsdp fit``) import it.
"""
