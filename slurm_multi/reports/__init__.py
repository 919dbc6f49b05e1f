"""What `slurm-multi report` shows: a job's record as text or as an HTML page."""
