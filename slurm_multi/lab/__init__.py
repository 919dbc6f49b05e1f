"""The built-in lab: a real SLURM cluster of Docker daemons on this machine, and its demo."""
