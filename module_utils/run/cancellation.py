"""How a signal stops a model run: SIGTERM, SIGINT and SIGHUP become a `Cancellation` the run's wait loop sees within
one poll, leaving it SLURM's KillWait to snapshot and stop the container and write the node's status."""

from __future__ import annotations

import signal
from typing import Callable

CANCEL_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Cancellation:
    """Set from a signal handler (or a test) to stop the run; the wait loop checks it every poll."""

    def __init__(self):
        self.reason = ""  # why the run was asked to stop; the first reason is kept

    def request(self, reason: str) -> None:
        """Ask the run to stop."""
        self.reason = self.reason or reason

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return bool(self.reason)


def install_cancel_handlers(cancellation: Cancellation) -> Callable[[], None]:
    """Route SIGTERM/SIGINT/SIGHUP to ``cancellation`` (main thread only); returns a function restoring the old ones."""

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        cancellation.request(f"cancelled by {name} (scancel, the job's time limit, or the controller gone)")

    previous = {signum: signal.signal(signum, handler) for signum in CANCEL_SIGNALS}

    def restore():
        for signum, old in previous.items():
            signal.signal(signum, old)

    return restore
