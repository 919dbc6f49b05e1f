"""Images: their names, the build, the registry, rank 0's announcement and the stream between nodes."""
