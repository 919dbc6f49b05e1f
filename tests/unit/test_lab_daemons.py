"""The lab's daemon start-up checks, on real processes (no lab needed)."""

import subprocess
import sys
import time

import pytest

from slurm_multi.lab import LabError, _has_exited, _wait_for


def test_a_running_process_has_not_exited():
    with subprocess.Popen(["sleep", "30"]) as proc:
        try:
            assert not _has_exited(proc.pid)
        finally:
            proc.kill()


def test_a_dead_process_has_exited_even_before_it_is_reaped():
    proc = subprocess.Popen(["true"])
    time.sleep(0.5)  # now a zombie: dead, not yet reaped
    assert _has_exited(proc.pid)
    proc.wait()
    assert _has_exited(proc.pid)


def test_waiting_on_a_daemon_that_execs_does_not_take_it_for_dead(tmp_path):
    # A shell that execs another program, as setpriv execs munged: the pid stays, its command line changes.
    ready = tmp_path / "ready"
    with subprocess.Popen(["sh", "-c", f'exec {sys.executable} -c "import pathlib, time; '
                                       f'time.sleep(0.5); pathlib.Path(\'{ready}\').touch(); time.sleep(30)"']) as proc:
        try:
            _wait_for(ready.exists, 20, "the test daemon", tmp_path / "log", proc.pid)
        finally:
            proc.kill()


def test_waiting_on_a_daemon_that_dies_names_it_and_shows_its_log(tmp_path):
    log = tmp_path / "daemon.log"
    log.write_text("fatal: cannot bind port 6817\n")
    with subprocess.Popen(["true"]) as proc:
        with pytest.raises(LabError, match="the test daemon exited while starting(.|\n)*cannot bind port 6817"):
            _wait_for(lambda: False, 20, "the test daemon", log, proc.pid)
