"""The rank-0 TCP barrier: every node holds the image before any container starts."""
