"""slurm_multi/pipeline_stop.py on real processes: the stop TERMs the pipeline's group and waits for every process of
the pipeline's sessions, also one in a session of its own as an Ansible worker's run module is."""

import contextlib
import os
import signal
import subprocess
import time

from slurm_multi.pipeline_stop import _processes, descendants, stop_pipeline

# A worker's run module: in its own session (setsid), so the group's TERM misses it; it writes its status 1 s later.
PIPELINE = """
setsid bash -c 'sleep 1; echo written > "$1"' _ "$1" &
trap 'exit 143' TERM
while :; do sleep 0.1; done
"""


def test_the_stop_waits_for_the_processes_of_the_pipelines_other_sessions(tmp_path):
    status = tmp_path / "status.json"
    pipeline = subprocess.Popen(["bash", "-c", PIPELINE, "_", str(status)], start_new_session=True)
    try:
        _started(pipeline)
        said = []
        stop_pipeline(pipeline.pid, None, drain=10, say=said.append)
        assert pipeline.wait(timeout=5) == 143
        assert status.read_text() == "written\n"
        assert said == []
    finally:
        pipeline.kill()


def _started(pipeline):
    """The pipeline's processes, once one of them runs in a session of its own."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        table = _processes()
        found = descendants(pipeline.pid, table)
        if any(table[pid][1] != pipeline.pid for pid in found):
            return found
        time.sleep(0.05)
    raise AssertionError("the pipeline's own-session process never started")


def test_a_stop_that_outlasts_its_drain_says_so():
    pipeline = subprocess.Popen(
        ["bash", "-c", "setsid sleep 30 & trap 'exit 143' TERM; while :; do sleep 0.1; done"], start_new_session=True
    )
    started = _started(pipeline)
    try:
        said = []
        stop_pipeline(pipeline.pid, None, drain=0.5, say=said.append)
        assert said and "still run 0.5 s after the stop" in said[0]
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_process_name_with_spaces_and_parentheses_is_read_whole(tmp_path):
    odd = tmp_path / "a) b (c"
    odd.write_text("#!/bin/sh\nsleep 30\n")
    odd.chmod(0o755)
    process = subprocess.Popen([str(odd)], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while process.pid not in _processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes()[process.pid] == (os.getpid(), process.pid, "a) b (c")
    finally:
        process.kill()
