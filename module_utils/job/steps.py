"""The steps a node records of a job: their names and times, as its modules return them (``step: {name, start,
end}``, `timed_step` in module_runner) and its status.json holds them (``steps``). Standard library only."""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Iterable, Mapping, Optional

# The steps a node may record, in the order a run does them (docs/contracts.md, status.json ``steps``).
STEPS = ("preflight", "build", "publish", "load", "barrier", "container_start", "run", "diagnostics")


def step_record(start: float, end: Optional[float] = None) -> Dict[str, float]:
    """One step's times: ``{"start": <epoch s>, "end": <epoch s>}`` (end: now when not given)."""
    return {"start": round(float(start), 3), "end": round(float(time.time() if end is None else end), 3)}


def _valid_times(times: Any) -> bool:
    if not isinstance(times, Mapping):
        return False
    start, end = times.get("start"), times.get("end")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (start, end))
    return numbers and end >= start


def merge_steps(results: Iterable[Any]) -> Dict[str, Dict[str, float]]:
    """The steps a node's registered module results carry, by name; anything else (a skipped or never-run task, an
    unknown name, broken times) is left out, and a later result of the same step wins."""
    steps = {}  # type: Dict[str, Dict[str, float]]
    for result in results:
        step = result.get("step") if isinstance(result, Mapping) else None
        if isinstance(step, Mapping) and step.get("name") in STEPS and _valid_times(step):
            steps[step["name"]] = {"start": float(step["start"]), "end": float(step["end"])}
    return steps


def valid_steps(steps: Any) -> Dict[str, Dict[str, float]]:
    """A status's ``steps`` with only the known step names and sound times, in the run's order."""
    if not isinstance(steps, Mapping):
        return {}
    return {name: dict(steps[name]) for name in STEPS if name in steps and _valid_times(steps[name])}


def duration(times: Mapping[str, float]) -> float:
    """A step's seconds."""
    return float(times["end"]) - float(times["start"])
