"""Running the model's container on a node: its spec, launcher, mounts, secrets, log and diagnostics."""
