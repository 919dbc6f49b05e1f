"""Readable progress of a pipeline run: one line per finished task, naming the stage and each node's outcome.

Two sources feed the same `PipelineProgress`: the Ansible output of a submitted job, line by line as it lands in
the job's output file (`feed_output_line`), and ansible-runner's events when the pipeline runs in this process
(`feed_runner_event`).
"""

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import hostlist

_PLAY = re.compile(r"^PLAY \[(?P<name>.*)\] \**\s*$")
_TASK = re.compile(r"^(?:TASK|RUNNING HANDLER) \[(?:(?P<role>[^:\]]+) : )?(?P<name>.*)\] \**\s*$")
_RECAP = re.compile(r"^PLAY RECAP \**\s*$")
_HOST_RESULT = re.compile(
    r"^(?P<status>ok|changed|fatal|failed|skipping|unreachable): \[(?P<host>[^\]\s]+)(?: -> [^\]]+)?\]"
    r"(?:: (?P<verdict>FAILED|UNREACHABLE)!)?(?: => (?P<rest>.*))?$"
)
_MESSAGE = re.compile(r"""^\s+"?msg"?:\s*(?P<msg>.*?),?\s*$""")
_OUR_LINES = "slurm-multi:"
# Pull mode: srun --label puts the task's rank (padded to the widest) before each line of that node's Ansible output.
_SRUN_LABEL = re.compile(r"^\s*(?P<task>\d+): (?P<line>.*)$")
_FAILED_STATUSES = ("fatal", "failed", "unreachable")
# ansible-runner event -> the word the default callback prints for it.
_RUNNER_STATUS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipping",
}
MESSAGE_LIMIT = 300


class PipelineProgress:
    """Collects each task's per-node outcomes and reports a line when the task is over."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report = report
        self.stage = ""
        self.task: str | None = None
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}
        self._awaiting_message: str | None = None
        # Pull mode: one ansible-playbook per node, their lines interleaved; each node's are followed on their own.
        self._per_task: dict[str, PipelineProgress] = {}

    def play_started(self, name: str) -> None:
        """A new play: its name is the stage until a role names one."""
        self.task_finished()
        self.stage = name

    def task_started(self, name: str, role: str | None = None) -> None:
        """A new task; the previous one is reported."""
        self.task_finished()
        self.task = name
        if role:
            self.stage = role

    def host_result(self, host: str, status: str, message: str = "") -> None:
        """One node's outcome of the current task (``ok``, ``changed``, ``failed``, ``unreachable``, ``skipping``)."""
        self.outcomes[host] = status
        if message:
            self.messages[host] = message[:MESSAGE_LIMIT]

    def task_finished(self) -> None:
        """Report the current task, if any node has an outcome for it."""
        self._awaiting_message = None
        if self.task is not None and self.outcomes:
            self.report(self._summary())
        self.task = None
        self.outcomes = {}
        self.messages = {}

    def _summary(self) -> str:
        by_status: dict[str, list[str]] = {}
        for host, status in self.outcomes.items():
            by_status.setdefault(status, []).append(host)
        parts = []
        for status in sorted(by_status, key=lambda s: (s in _FAILED_STATUSES, s)):
            hosts = hostlist.collect_hostlist(by_status[status])
            label = status.upper() if status in _FAILED_STATUSES else status
            parts.append(f"{label} {hosts}")
        line = f"[{self.stage or 'pipeline'}] {self.task}: " + ", ".join(parts)
        failures = [f"{host}: {msg}" for host, msg in self.messages.items() if self.outcomes[host] in _FAILED_STATUSES]
        return line + ("".join(f"\n    {failure}" for failure in failures))

    def feed_output_line(self, line: str) -> None:
        """One line of the pipeline's Ansible output (the default callback's format)."""
        line = line.rstrip("\n")
        labelled = _SRUN_LABEL.match(line)
        if labelled:
            task = labelled.group("task")
            if task not in self._per_task:
                self._per_task[task] = PipelineProgress(self.report)
            self._per_task[task].feed_output_line(labelled.group("line"))
            return
        if line.startswith(_OUR_LINES):
            self.task_finished()
            self.report(line)
            return
        if self._awaiting_message:
            found = _MESSAGE.match(line)
            if found:
                self.messages[self._awaiting_message] = found.group("msg").strip("'\"")[:MESSAGE_LIMIT]
                self._awaiting_message = None
                return
        if found := _PLAY.match(line):
            return self.play_started(found.group("name"))
        if found := _TASK.match(line):
            return self.task_started(found.group("name"), found.group("role"))
        if _RECAP.match(line):
            return self.task_finished()
        found = _HOST_RESULT.match(line)
        if found and self.task is not None:
            status, host = found.group("status"), found.group("host")
            if found.group("verdict") == "UNREACHABLE":
                status = "unreachable"
            self.host_result(host, status)
            if status in _FAILED_STATUSES:
                rest = (found.group("rest") or "").strip()
                inline = re.search(r'"msg":\s*"((?:[^"\\]|\\.)*)"', rest)
                if inline:
                    self.messages[host] = inline.group(1)[:MESSAGE_LIMIT]
                else:
                    self._awaiting_message = host

    def feed_runner_event(self, event: Mapping) -> None:
        """One ansible-runner event."""
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        if kind == "playbook_on_play_start":
            self.play_started(str(data.get("play", "")))
        elif kind == "playbook_on_task_start":
            self.task_started(str(data.get("task", "")), data.get("role") or None)
        elif kind in _RUNNER_STATUS and data.get("host"):
            status = _RUNNER_STATUS[kind]
            result = data.get("res") or {}
            if status == "ok" and result.get("changed"):
                status = "changed"
            message = str(result.get("msg", "")) if status in _FAILED_STATUSES and isinstance(result, dict) else ""
            self.host_result(str(data["host"]), status, message)
        elif kind == "playbook_on_stats":
            self.task_finished()


def preflight_line(node: str, problems: list) -> str:
    """One node's row of the preflight table: ``ok``, or each problem with its fix."""
    if not problems:
        return f"[preflight] {node}: ok"
    rows = [
        f"\n    {item.get('check')}: {item.get('problem')}\n      fix: {item.get('fix')}"
        for item in problems
        if isinstance(item, Mapping)
    ]
    return f"[preflight] {node}: PROBLEM" + "".join(rows)


def preflight_lines(attempt_dir: Path, shown: set) -> list[str]:
    """The preflight table's rows of the nodes whose result (``<attempt_dir>/preflight/<node>.json``) appeared
    since the last call; ``shown`` keeps the nodes already reported."""
    lines = []
    for path in sorted(Path(attempt_dir).glob("preflight/*.json")):
        node = path.stem
        if node in shown:
            continue
        try:
            problems = json.loads(path.read_text()).get("problems")
        except (OSError, ValueError, AttributeError):
            continue  # written by rename: a partial read only happens on a file being replaced
        if isinstance(problems, list):
            shown.add(node)
            lines.append(preflight_line(node, problems))
    return lines
