"""What a user looks at first: every rank's log as it is written (`slurm-multi logs`), and the job's stage
timeline with its stragglers (`slurm-multi report --job`).

`NodeLogs` reads the lines each node's ``run.log`` gained since the last call, so polling every file in turn
interleaves the ranks as they write, each line prefixed ``node3 r2 | ``. The timeline comes from the job's record,
or before it is recorded from the nodes' status.json files (module_utils/results/timeline.py).
"""

import bisect
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.timeline import (
    job_timeline,
    straggler_lines,
    timeline_table,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import expand_nodelist
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.submission.sbatch import ACTIVE_JOB_STATES

# One colour per node, cycled (bright variants read well on dark and light terminals alike).
_COLOURS = ("36", "33", "35", "32", "34", "31", "96", "93", "95", "92", "94", "91")
_RESET = "\033[0m"
# Beside each run.log: when its lines were written (module_utils/run/container_log.py).
RUN_LOG_TIMES_SUFFIX = ".times"
# A log line longer than this (a progress bar without newlines) is shown in parts.
_MAX_LINE = 1 << 20


class JobLogsError(UserError):
    """A job whose logs cannot be shown (no such job, bad filter), with what to do."""


def use_colour(stream) -> bool:
    """Colours on a terminal only, and never when NO_COLOR is set (https://no-color.org)."""
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")


class FileTail:
    """The complete lines a growing file gained since the last call (a partial last line waits for its end), each
    with the byte offset it starts at."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def new_lines(self, final: bool = False) -> list[tuple[int, str]]:
        try:
            # Never through a symlink: one planted in a shared results dir must not make us print another file.
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size < self.offset:  # rewritten from scratch (the run module refetched a broken-off log)
                    self.offset, self.partial = 0, b""
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        at = self.offset - len(self.partial)
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        out = []
        for line in lines:
            for start in range(0, max(len(line), 1), _MAX_LINE):
                out.append((at + start, line[start : start + _MAX_LINE].decode("utf-8", "replace").rstrip("\r")))
            at += len(line) + 1
        return out


class _LineTimes:
    """When a node's log lines were written, from its ``run.log.times`` (``<byte offset> <epoch>`` marks the run
    module writes; container_log.py): a line's time is that of the last mark at or before its offset, or None."""

    def __init__(self, path: Path) -> None:
        self.tail = FileTail(path)
        self.offsets: list[int] = []
        self.times: list[float] = []

    def time_of(self, offset: int) -> float | None:
        for _, text in self.tail.new_lines():
            at, _, when = text.partition(" ")
            try:
                mark_offset, mark_time = int(at), float(when)
            except ValueError:
                continue
            if self.offsets and mark_offset < self.offsets[-1]:  # the log was rewritten from scratch
                self.offsets, self.times = [], []
            self.offsets.append(mark_offset)
            self.times.append(mark_time)
        index = bisect.bisect_right(self.offsets, offset) - 1
        return self.times[index] if index >= 0 else None


class NodeLogs:
    """Every node's run.log of one attempt, read line by line as the nodes write them.

    ``node`` or ``rank`` keeps one node's lines only; ``nodelist`` is the job's nodes in rank order (SLURM's), the
    ranks of nodes that have written no status.json yet.
    """

    def __init__(
        self,
        attempt_dir: str | Path,
        node: str | None = None,
        rank: int | None = None,
        nodelist: Sequence[str] = (),
        colour: bool = False,
    ) -> None:
        self.nodes_dir = Path(job_layout.nodes_dir(str(attempt_dir)))
        self.node, self.rank = node, rank
        self.nodelist = list(nodelist)
        self.colour = colour
        self.tails: dict[str, FileTail] = {}
        self.line_times: dict[str, _LineTimes] = {}
        self.ranks: dict[str, int | None] = {}

    def _rank_of(self, node: str) -> int | None:
        if self.ranks.get(node) is None:
            try:
                rank = safe_files.read_json_file(str(self.nodes_dir / node / job_layout.STATUS_FILE)).get("rank")
            except (OSError, ValueError, AttributeError):
                rank = None
            if not isinstance(rank, int) and node in self.nodelist:
                rank = self.nodelist.index(node)
            self.ranks[node] = rank if isinstance(rank, int) else None
        return self.ranks[node]

    def nodes(self) -> list[str]:
        """The nodes with a run.log so far (after the filter), in rank order."""
        try:
            found = [path.parent.name for path in self.nodes_dir.glob(f"*/{job_layout.RUN_LOG}")]
        except OSError:
            return []
        if self.node is not None:
            found = [name for name in found if name == self.node]
        if self.rank is not None:
            found = [name for name in found if self._rank_of(name) == self.rank]
        return sorted(found, key=lambda name: (self._rank_of(name) is None, self._rank_of(name) or 0, name))

    def prefix(self, node: str) -> str:
        rank = self._rank_of(node)
        text = f"{node} r{'?' if rank is None else rank} | "
        if not self.colour:
            return text
        index = (rank if rank is not None else sum(map(ord, node))) % len(_COLOURS)
        return f"\033[{_COLOURS[index]}m{text}{_RESET}"

    def new_lines(self, final: bool = False) -> list[str]:
        """The lines every node wrote since the last call, each prefixed with its node and rank, in the order they
        were written (by their run.log.times marks; a node's own lines keep their order, nodes without marks come
        after, in rank order)."""
        timed = []
        for order, node in enumerate(self.nodes()):
            tail = self.tails.setdefault(node, FileTail(self.nodes_dir / node / job_layout.RUN_LOG))
            lines = tail.new_lines(final)
            if not lines:
                continue
            times = self.line_times.setdefault(
                node, _LineTimes(self.nodes_dir / node / (job_layout.RUN_LOG + RUN_LOG_TIMES_SUFFIX))
            )
            prefix = self.prefix(node)
            for seq, (offset, line) in enumerate(lines):
                when = times.time_of(offset)
                timed.append(((when is None, when or 0.0, order, seq), prefix + line))
        return [line for _, line in sorted(timed, key=lambda item: item[0])]


def job_nodelist(info: Mapping[str, str] | None) -> list[str]:
    """The job's nodes in rank order from SLURM's view of it (``NodeList``), [] before it has any."""
    nodelist = (info or {}).get("NodeList", "")
    return expand_nodelist(nodelist) if nodelist and not nodelist.startswith("(") else []


def follow_logs(
    results_dir: str | Path,
    job_id: str,
    *,
    follow: bool = False,
    node: str | None = None,
    rank: int | None = None,
    emit: Callable[[str], None] = print,
    colour: bool = False,
    poll_interval: float = 0.5,
    job_info: Callable[[str], Mapping[str, str] | None] | None = None,
) -> int:
    """Show the job's logs (every rank's, or one node's or rank's); with ``follow``, until the job has ended (one
    SLURM's ``job_info`` does not know: once its attempt is recorded). Returns the number of lines shown; when there
    were none, a line says why. JobLogsError when neither the results dir nor SLURM knows the job."""
    try:
        job_id = job_layout.validate_job_id(job_id)
    except job_layout.JobLayoutError as exc:
        raise JobLogsError(str(exc)) from None
    results_dir = str(results_dir)
    ask_slurm = job_info if job_info is not None and job_layout.is_slurm_job_number(job_id) else None
    info = ask_slurm(job_id) if ask_slurm else None
    if info is None and not os.path.isdir(job_layout.job_dir(results_dir, job_id)):
        raise JobLogsError(
            f"no job {job_id} in {results_dir}, and SLURM knows no such job: check the ID, or give the results dir "
            "the job wrote to (--results-dir)"
        )
    attempt = _attempt(results_dir, job_id, info)
    logs = NodeLogs(job_layout.attempt_dir(results_dir, job_id, attempt), node, rank, job_nodelist(info), colour)
    shown = 0

    def show(lines: list[str]) -> None:
        nonlocal shown
        for line in lines:
            emit(line)
        shown += len(lines)

    said_pending = False
    while True:
        show(logs.new_lines())
        if not follow or not _running(info, ask_slurm is not None, results_dir, job_id, attempt):
            break
        if (info or {}).get("JobState") == "PENDING" and not said_pending:
            why = (info or {}).get("Reason", "")
            emit(f"job {job_id} is PENDING{f' ({why})' if why not in ('', 'None') else ''}: waiting for it to start")
            said_pending = True
        time.sleep(poll_interval)
        if ask_slurm:
            info = ask_slurm(job_id)
            logs.nodelist = job_nodelist(info) or logs.nodelist
            if info is not None and _attempt(results_dir, job_id, info) != attempt:
                # SLURM requeued the job: its next attempt writes under its own number.
                show(logs.new_lines(final=True))
                attempt = _attempt(results_dir, job_id, info)
                emit(f"job {job_id}: attempt {attempt} (SLURM requeued it)")
                logs = NodeLogs(job_layout.attempt_dir(results_dir, job_id, attempt), node, rank, logs.nodelist, colour)
    show(logs.new_lines(final=True))
    if shown == 0:
        emit(_why_no_lines(job_id, attempt, (info or {}).get("JobState"), logs))
    return shown


def _running(info: Mapping[str, str] | None, slurm_job: bool, results_dir: str, job_id: str, attempt: int) -> bool:
    """Whether the job may still write logs: SLURM says it is active; one SLURM forgot has ended; a job SLURM
    does not know (a local run) runs until its attempt is recorded."""
    if info is not None:
        return info.get("JobState") in ACTIVE_JOB_STATES
    if slurm_job:
        return False
    return not os.path.isfile(job_layout.attempt_record_path(results_dir, job_id, attempt))


def _attempt(results_dir: str, job_id: str, info: Mapping[str, str] | None) -> int:
    restarts = (info or {}).get("Restarts", "")
    return int(restarts) if restarts.isdigit() else job_layout.latest_attempt(results_dir, job_id)


def _why_no_lines(job_id: str, attempt: int, state: str | None, logs: NodeLogs) -> str:
    where = os.path.dirname(str(logs.nodes_dir))
    any_log = any(Path(logs.nodes_dir).glob(f"*/{job_layout.RUN_LOG}"))
    if any_log and (logs.node is not None or logs.rank is not None):
        which = f"node {logs.node}" if logs.node is not None else f"rank {logs.rank}"
        return f"job {job_id}: {which} has no run.log under {where} (other nodes have one)"
    if state == "PENDING":
        return f"job {job_id} has not started yet (PENDING): no node has written a log; --follow waits for it"
    if not any_log:
        now = f"SLURM state {state}" if state else "it has ended"
        return (
            f"job {job_id} started no model run on any node yet ({now}): no run.log under {where}. "
            f"If it has ended, its record says why: slurm-multi report --job {job_id}"
        )
    return f"job {job_id}: its nodes' logs under {where} hold no lines yet"


# --- The stage timeline ------------------------------------------------------------------------------------------


def _node_statuses(results_dir: str, job_id: str) -> dict:
    attempt = job_layout.latest_attempt(results_dir, job_id)
    nodes_dir = Path(job_layout.nodes_dir(job_layout.attempt_dir(results_dir, job_id, attempt)))
    statuses = {}
    for path in sorted(nodes_dir.glob(f"*/{job_layout.STATUS_FILE}")):
        try:
            statuses[path.parent.name] = safe_files.read_json_file(str(path))
        except (OSError, ValueError):
            statuses[path.parent.name] = None
    return dict(sorted(statuses.items(), key=lambda item: ((item[1] or {}).get("rank", 1 << 30), item[0])))


def timeline_lines(results_dir: str | Path, job_id: str) -> list[str]:
    """The job's stage timeline as a person reads it: the per-node table (seconds from the job's first step, as
    start+duration), each step's straggler, each node's barrier wait, and the cross-node summary of its figures."""
    results_dir = str(results_dir)
    try:
        job_id = job_layout.validate_job_id(job_id)
    except job_layout.JobLayoutError as exc:
        return [f"Stage timeline: none: {exc}"]
    try:
        record = safe_files.read_json_file(job_layout.job_record_path(results_dir, job_id))
    except (OSError, ValueError):
        record = None
    sweep = record.get("sweep") if isinstance(record, dict) else None
    if isinstance(sweep, list) and "timeline" not in record:
        # A sweep's record names its models' runs, each with its own record and timeline.
        lines = []
        for model in sweep:
            if isinstance(model, dict) and job_layout.is_job_id(model.get("job_id")):
                lines += [f"model {model.get('index')} {model.get('model')} (job {model['job_id']}):"]
                lines += ["  " + line for line in timeline_lines(results_dir, str(model["job_id"]))]
        return lines or [f"Stage timeline: the sweep {job_id} names no model run"]
    if isinstance(record, dict) and isinstance(record.get("timeline"), dict):
        timeline = record["timeline"]
        source = f"record of job {job_id}, attempt {record.get('attempt')}"
    elif isinstance(record, dict):
        return [f"Stage timeline: the record of job {job_id} has none (recorded before nodes recorded step times)"]
    else:
        timeline = job_timeline(_node_statuses(results_dir, job_id))
        record = record if isinstance(record, dict) else {}
        source = f"job {job_id}'s node statuses (not recorded yet)"
    if not any(timeline.values()):
        return [f"Stage timeline: none recorded ({source})"]
    lines = [f"Stage timeline ({source}; seconds from the first step, start+duration):"]
    lines += timeline_table(timeline).splitlines()
    lines += straggler_lines(timeline)
    lines += summary_lines(record.get("perf_summary") or {})
    return lines


def summary_lines(perf_summary: Mapping[str, Mapping]) -> list[str]:
    """One line per figure several nodes reported: mean, std, cv, the nodes' count and any outlier."""
    lines = []
    for metric, summary in perf_summary.items():
        if not isinstance(summary, Mapping) or (summary.get("n_nodes") or 0) < 2:
            continue
        cv = summary.get("cv")
        per_node = summary.get("per_node") or {}
        outliers = [f"{name} {per_node[name]:.4g}" for name in summary.get("outliers") or [] if name in per_node]
        lines.append(
            f"{metric} across {summary['n_nodes']} nodes: mean {summary['mean']:.4g}, std {summary['std']:.3g}"
            + (f", cv {cv:.1%}" if cv is not None else "")
            + (f"; outlier: {', '.join(outliers)}" if outliers else "")
        )
    return lines


def hang_lines(results_dir: str | Path, job_id: str) -> list[str]:
    """A hung run's finding (the record's ``hang``: module_utils/run/hang/finding.py) as a person reads it: who is stuck
    and who waits, then where each node's stacks are; [] when the job's record holds none."""
    try:
        job_id = job_layout.validate_job_id(job_id)
        record = safe_files.read_json_file(job_layout.job_record_path(str(results_dir), job_id))
        attempt_dir = job_layout.attempt_dir(str(results_dir), job_id, record.get("attempt") or 0)
    except (job_layout.JobLayoutError, OSError, ValueError, AttributeError):
        return []
    hang = record.get("hang")
    if not isinstance(hang, Mapping):
        return []
    stacks = hang.get("stacks") if isinstance(hang.get("stacks"), Mapping) else {}
    lines = [f"Hang ({hang.get('kind', 'unknown')}): {hang.get('summary', '')}"]
    lines += [f"  {node}'s stacks: {os.path.join(attempt_dir, str(path))}" for node, path in stacks.items()]
    return lines
