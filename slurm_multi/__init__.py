"""slurm-multi: one containerized benchmark or training across several GPU nodes of a SLURM cluster."""

__version__ = "0.1.0"
