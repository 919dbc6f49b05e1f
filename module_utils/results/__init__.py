"""After a run: the per-node results, the verdict, the perf record and the stage timeline."""
