"""Per task and host: when Ansible started it and when its result came back (benchmarks only).

Enable with ANSIBLE_CALLBACK_PLUGINS=<this dir> ANSIBLE_CALLBACKS_ENABLED=task_profile and
TASK_PROFILE_FILE=<path>: one JSON line per event is appended to that file (playbook start, task start, host
result, end), with wall-clock times and the controller process's CPU seconds (its children included); the
playbook event also says when the process started.
"""

import json
import os
import resource
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: task_profile
type: aggregate
short_description: Append per-task, per-host timings to the file TASK_PROFILE_FILE names
description: [Benchmarks only; see benchmarks/README.md.]
"""


def _process_start():
    """When this process started, on the wall clock (10 ms steps): its start in ticks since boot (/proc/self/stat),
    against the boot clock now. The playbook's span then includes Python's and Ansible's own start."""
    with open("/proc/self/stat") as stat:
        started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def _cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_profile"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._path = os.environ.get("TASK_PROFILE_FILE")

    def _write(self, **event):
        if self._path:
            event.update(t=time.time(), cpu=_cpu(), pid=os.getpid())
            with open(self._path, "a") as handle:
                handle.write(json.dumps(event) + "\n")

    def v2_playbook_on_start(self, playbook):
        self._write(event="playbook", name=os.path.basename(playbook._file_name), process_start=_process_start())

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._write(event="task", name=task.get_name(), role=task._role.get_name() if task._role else "")

    def v2_playbook_on_handler_task_start(self, task):
        self.v2_playbook_on_task_start(task, False)

    def _result(self, result, status):
        self._write(event="result", host=result._host.get_name(), status=status, name=result._task.get_name())

    def v2_runner_on_ok(self, result):
        self._result(result, "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._result(result, "failed")

    def v2_runner_on_skipped(self, result):
        self._result(result, "skipped")

    def v2_runner_on_unreachable(self, result):
        self._result(result, "unreachable")

    def v2_playbook_on_stats(self, stats):
        self._write(event="end")
