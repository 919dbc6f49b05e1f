"""Docker: a daemon on every node (docs/runtimes.md)."""
