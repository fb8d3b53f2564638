"""The fault-tolerant core: control plane (lighthouse, quorum), data plane (FTAR) and the per-rank manager.

Framework-agnostic: nothing here imports Lightning or Accelerate.
"""
