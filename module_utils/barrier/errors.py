"""The barrier's errors: what a node reports when the barrier does not release, each with what to check."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


class BarrierError(UserError):
    """The barrier did not release: the message says why and what to check."""

    def __init__(self, message: str, rejections: Sequence[dict] = ()):
        super().__init__(message)
        self.rejections = list(rejections)


class BarrierConfigError(BarrierError):
    """A barrier setting that cannot work as given (bad port range, rank, address, token shape...)."""


class BarrierTimeout(BarrierError):
    """The deadline passed; on rank 0, `missing` lists the ranks that never arrived as (rank, hostname or None)."""

    def __init__(self, message: str, missing: Sequence[Tuple[int, Optional[str]]] = (), rejections=()):
        super().__init__(message, rejections)
        self.missing = list(missing)


class BarrierAborted(BarrierError):
    """The barrier was given up: rank 0 aborted it (a node has another image, or its deadline passed), or the
    worker's `abort_check` reported that the run ended elsewhere (rank 0 could not open the barrier)."""

    def __init__(self, message: str, reason: str, rejections=()):
        super().__init__(message, rejections)
        self.reason = reason


class BarrierFailed(BarrierError):
    """The barrier ended without GO, as a module reports it: `fields` go into the task's result."""

    def __init__(self, message: str, fields: Dict[str, Any]):
        super().__init__(message, fields.get("rejected") or ())
        self.fields = fields
