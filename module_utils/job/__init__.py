"""One job's files on shared storage: the results layout, the ABORT marker, the run claim, the config."""
