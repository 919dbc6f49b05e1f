"""From the login node: a job submitted with sbatch, followed to its end, recorded, retried."""
