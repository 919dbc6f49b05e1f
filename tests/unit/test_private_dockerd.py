"""The private dockerd of the real-daemon tests (tests/support/dockerd.py): a skip says it is no pass, and a root run
never skips them (a missing dockerd is an error that names it)."""

import os
import tempfile

import pytest

from tests.support import dockerd


def test_not_root_skips_saying_ci_runs_it_and_a_skip_is_no_pass(monkeypatch):
    monkeypatch.setattr(dockerd.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception) as skipped:
        with dockerd.running_private_dockerd("slurm-multi-never-"):
            pass
    assert str(skipped.value) == (
        "needs root to start a private dockerd; CI runs as root, so this runs there - a skip here is not a pass"
    )


def test_as_root_a_missing_dockerd_is_an_error_naming_it_not_a_skip(monkeypatch, tmp_path):
    monkeypatch.setattr(dockerd.os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))  # no dockerd, no docker
    with pytest.raises(pytest.fail.Exception) as failed:
        with dockerd.running_private_dockerd("slurm-multi-never-"):
            pass
    message = str(failed.value)
    assert "running as root, but dockerd and docker are not on PATH" in message
    assert "these tests must run as root, never skip" in message
    assert not [name for name in os.listdir(tempfile.gettempdir()) if name.startswith("slurm-multi-never-")]
