"""How a signal stops a model run: SIGTERM, SIGINT and SIGHUP become a `Cancellation` the run's wait loop sees.

SLURM signals a step's processes when the job is cancelled (scancel), reaches its time limit, or loses its
controller; it sends SIGKILL KillWait (30 s by default) after the SIGTERM. The handler only records the request:
the wait loop (module_utils/run/model_run.py) sees it within one poll and has that long to snapshot the container,
stop it and write the node's status.
"""

from __future__ import annotations

import signal
from typing import Callable, Optional

CANCEL_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Cancellation:
    """Set from a signal handler (or a test) to stop the run; the wait loop checks it every poll."""

    def __init__(self):
        self._reason: Optional[str] = None

    def request(self, reason: str) -> None:
        """Ask the run to stop; the first reason is kept."""
        if self._reason is None:
            self._reason = reason

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self._reason is not None

    @property
    def reason(self) -> str:
        """Why the run was asked to stop."""
        return self._reason or ""


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
