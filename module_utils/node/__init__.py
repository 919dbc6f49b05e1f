"""One node before a run: its facts, the preflight checks and the containers a run left behind."""
