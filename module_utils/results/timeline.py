"""When each node did each step of a job, who was slow, and how the ranks' figures spread: what collect makes of
the ``steps`` the nodes' status.json carry (job/steps.py). Pure functions: standard library only, Python 3.8+."""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import STEPS, duration, valid_steps

BARRIER = "barrier"
# A node is ready for the barrier once these are done: it holds the image.
_IMAGE_STEPS = ("build", "publish", "load")

# A step's slowest node is its straggler when it took more than this many times the median of the other nodes
# that did the step, and more than STRAGGLER_MIN_SECONDS longer: a second's jitter on a 0.2 s step is no story.
STRAGGLER_FACTOR = 1.5
STRAGGLER_MIN_SECONDS = 1.0

# A node's figure is an outlier when it lies more than OUTLIER_MADS scaled median absolute deviations from the
# median of the nodes' figures (the scale 1.4826 makes the MAD estimate a normal distribution's sigma). With
# three nodes or more only; when most figures are equal (MAD 0) a figure more than OUTLIER_FLAT_FRACTION away
# from the median is one.
OUTLIER_MADS = 3.0
MAD_SCALE = 1.4826
OUTLIER_FLAT_FRACTION = 0.05


def job_timeline(statuses: Mapping[str, Any]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{node: {step: {start, end}}}`` from the nodes' parsed status.json (None or broken ones give no steps)."""
    return {
        node: valid_steps(status.get("steps") if isinstance(status, Mapping) else None)
        for node, status in statuses.items()
    }


def ready_for_barrier(steps: Mapping[str, Mapping[str, float]]) -> float:
    """When a node was ready for the barrier: the end of its last image step (build, publish, load) before it,
    else the barrier's start."""
    barrier = steps[BARRIER]
    ends = [steps[name]["end"] for name in _IMAGE_STEPS if name in steps and steps[name]["end"] <= barrier["end"]]
    return min(max(ends), barrier["start"]) if ends else barrier["start"]


def barrier_waits(timeline: Mapping[str, Mapping[str, Mapping[str, float]]]) -> Dict[str, float]:
    """Each node's wait for the others: from when it was ready (`ready_for_barrier`) until the barrier let it go (in
    push mode a node waits for the slowest loader before its barrier task even starts)."""
    return {
        node: round(steps[BARRIER]["end"] - ready_for_barrier(steps), 3)
        for node, steps in timeline.items()
        if BARRIER in steps
    }


def stragglers(timeline: Mapping[str, Mapping[str, Mapping[str, float]]]) -> List[Dict[str, Any]]:
    """Per step (in the run's order), its slowest node against the others' median (STRAGGLER_FACTOR,
    STRAGGLER_MIN_SECONDS); none for the barrier, where who waits longest came first."""
    found = []
    for step in STEPS:
        if step == BARRIER:
            continue
        seconds = {node: duration(steps[step]) for node, steps in timeline.items() if step in steps}
        if not seconds:
            continue
        slowest = max(sorted(seconds), key=lambda node: seconds[node])
        others = [value for node, value in seconds.items() if node != slowest]
        median_others = statistics.median(others) if others else None
        ratio = seconds[slowest] / median_others if median_others else None
        straggler = (
            median_others is not None
            and seconds[slowest] > STRAGGLER_FACTOR * median_others
            and seconds[slowest] - median_others > STRAGGLER_MIN_SECONDS
        )
        found.append(
            {
                "step": step,
                "node": slowest,
                "seconds": round(seconds[slowest], 3),
                "nodes": len(seconds),
                "median_others": None if median_others is None else round(median_others, 3),
                "ratio": None if ratio is None else round(ratio, 2),
                "straggler": bool(straggler),
            }
        )
    return found


def last_at_barrier(timeline: Mapping[str, Mapping[str, Mapping[str, float]]]) -> Optional[str]:
    """The node that was ready for the barrier last (`ready_for_barrier`): the one every other node waited for."""
    starts = {node: ready_for_barrier(steps) for node, steps in timeline.items() if BARRIER in steps}
    return max(sorted(starts), key=lambda node: starts[node]) if len(starts) > 1 else None


def straggler_lines(timeline: Mapping[str, Mapping[str, Mapping[str, float]]]) -> List[str]:
    """What a person reads first: each step's straggler ("load: node3 took 41 s, 3.1x the median of the others"),
    each node's barrier wait and who arrived last."""
    lines = []
    for entry in stragglers(timeline):
        if entry["nodes"] < 2:
            continue
        head = f"{entry['step']}: {entry['node']} took {entry['seconds']:.1f} s"
        if entry["ratio"] is not None:
            head += f", {entry['ratio']:.1f}x the median of the others ({entry['median_others']:.1f} s)"
        else:
            head += f" (the others {entry['median_others']:.1f} s)"
        lines.append(head + ("" if entry["straggler"] else "; no straggler"))
    waits = barrier_waits(timeline)
    if waits:
        lines.append("barrier wait: " + ", ".join(f"{node} {seconds:.1f} s" for node, seconds in waits.items()))
        last = last_at_barrier(timeline)
        # Whoever came last after a sub-second wait is noise, not news.
        if last is not None and max(waits.values()) > STRAGGLER_MIN_SECONDS:
            lines.append(f"barrier: {last} arrived last; the others waited for it")
    return lines


def timeline_table(timeline: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """A per-node table: each step's start and duration in seconds from the job's first recorded step."""
    starts = [times["start"] for steps in timeline.values() for times in steps.values()]
    if not starts:
        return "(no step times recorded)"
    origin = min(starts)
    steps_done = [step for step in STEPS if any(step in steps for steps in timeline.values())]
    header = ["node"] + [f"{step} (start+s)" for step in steps_done]
    rows = [header]
    for node, steps in timeline.items():
        cells = [node]
        for step in steps_done:
            times = steps.get(step)
            cells.append("-" if times is None else f"{times['start'] - origin:.1f}+{duration(times):.1f}")
        rows.append(cells)
    widths = [max(len(row[index]) for row in rows) for index in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def figure_summary(values: Mapping[str, float]) -> Dict[str, Any]:
    """The cross-node summary of one figure the ranks report: ``per_node``, ``mean``, ``std`` (sample), ``cv`` (None for
    a mean of 0), ``n_nodes`` and ``outliers`` (beyond OUTLIER_MADS scaled MADs of the median)."""
    per_node = {node: float(value) for node, value in values.items()}
    figures = list(per_node.values())
    if not figures:
        return {"per_node": {}, "mean": None, "std": None, "cv": None, "n_nodes": 0, "median": None, "outliers": []}
    # On figures scaled below 1: two ranks printing 1e308 overflow a plain sum, and no record would be written. The
    # scale is a power of two, so scaling loses no bit of a figure.
    exponent = math.frexp(max(abs(value) for value in figures))[1]
    scaled = [math.ldexp(value, -exponent) for value in figures]
    mean = statistics.fmean(scaled) if hasattr(statistics, "fmean") else statistics.mean(scaled)
    std = statistics.stdev(scaled) if len(scaled) > 1 else 0.0
    median = statistics.median(scaled)
    outliers = []  # type: List[str]
    if len(scaled) >= 3:
        mad = MAD_SCALE * statistics.median(abs(value - median) for value in scaled)
        for node, value in zip(per_node, scaled):
            distance = abs(value - median)
            if (mad > 0 and distance > OUTLIER_MADS * mad) or (
                mad == 0 and distance > OUTLIER_FLAT_FRACTION * abs(median)
            ):
                outliers.append(node)
    return {
        "per_node": per_node,
        "mean": _unscaled(mean, exponent),
        "std": _unscaled(std, exponent),
        "cv": std / mean if mean else None,
        "n_nodes": len(figures),
        "median": _unscaled(median, exponent),
        "outliers": outliers,
    }


def _unscaled(value: float, exponent: int) -> Optional[float]:
    # A summary past the float range (a std of figures near 1e308) is no figure: None, as JSON can hold it.
    try:
        return math.ldexp(value, exponent)
    except OverflowError:
        return None


def cross_node_summary(per_node_figures: Mapping[str, Mapping[str, float]]) -> Dict[str, Dict[str, Any]]:
    """``{metric: figure_summary}`` from ``{node: {metric: value}}`` (each node's last figure per metric)."""
    by_metric = {}  # type: Dict[str, Dict[str, float]]
    for node, figures in per_node_figures.items():
        for metric, value in figures.items():
            by_metric.setdefault(metric, {})[node] = value
    return {metric: figure_summary(values) for metric, values in by_metric.items()}
