"""Charliecloud: an unprivileged runtime with no daemon; the ranks are the user's own processes (docs/runtimes.md)."""
