"""SLURM seen from a node: the allocation's hosts and the srun step that runs a task there."""
