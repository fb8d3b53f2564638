"""``fthsdp slurm``: a fault-tolerant job in one SLURM allocation (docs/slurm.md).

``cli`` writes the sbatch script (``script``) and submits it; inside the allocation ``supervise`` runs the launcher's
supervisor (``lightning_fthsdp.launch``) with a ``placement.SlurmPlacement``: the lighthouse and every replica group
run as job steps, a group on a lost node moves to a spare one (``nodes``), and ``queries`` asks SLURM about nodes and
steps.
"""
