"""`slurm-multi stacks JOB` refuses, with exit code 2 and what to do, a job it cannot take stacks of.

SLURM's answers are real: `scontrol show job -o` recorded on the lab (tests/fixtures/stacks/README.md), given back
by a stand-in scontrol on PATH. The stacks of a running job: tests/integration/run/test_hang_watchdog_lab.py.
"""

from pathlib import Path

import pytest

from slurm_multi.cli import EXIT_USAGE, main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "stacks"
JOB = "1139"  # the recorded job


@pytest.fixture
def slurm_says(tmp_path, monkeypatch):
    """Put an scontrol on PATH that answers as SLURM did for the recorded job in ``state``."""

    def answer(state):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        recorded = FIXTURES / f"scontrol-show-job-{state}"
        if state == "unknown":
            script = f"#!/bin/sh\ncat '{recorded}.stderr' >&2\nexit 1\n"
        else:
            script = f"#!/bin/sh\ncat '{recorded}.txt'\n"
        for command, text in (("scontrol", script), ("srun", "#!/bin/sh\necho srun was run >&2\nexit 99\n")):
            (bin_dir / command).write_text(text)
            (bin_dir / command).chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    return answer


def _stacks(tmp_path, capsys, results_dir):
    code = main(["stacks", JOB, "--results-dir", str(results_dir)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_job_slurm_does_not_know_is_refused_naming_the_job(tmp_path, capsys, slurm_says):
    slurm_says("unknown")
    code, out, err = _stacks(tmp_path, capsys, tmp_path)
    assert (code, out) == (EXIT_USAGE, "")
    assert f"SLURM knows no job {JOB}" in err and "squeue" in err


def test_a_job_that_no_longer_runs_is_refused_with_its_state_and_where_a_hangs_stacks_are(tmp_path, capsys, slurm_says):
    slurm_says("cancelled")
    code, out, err = _stacks(tmp_path, capsys, tmp_path)
    assert (code, out) == (EXIT_USAGE, "")
    assert f"job {JOB} is CANCELLED, not running" in err and "stacks.txt" in err


def test_a_results_dir_without_the_running_job_is_refused_naming_the_dir_and_the_option(tmp_path, capsys, slurm_says):
    slurm_says("running")
    elsewhere = tmp_path / "other-results"
    elsewhere.mkdir()
    code, out, err = _stacks(tmp_path, capsys, elsewhere)
    assert (code, out) == (EXIT_USAGE, "")
    assert str(elsewhere / JOB / "attempt-0") in err and "--results-dir" in err
    assert "srun was run" not in err


def test_a_job_id_that_is_an_option_never_reaches_scontrol(tmp_path, capsys, monkeypatch):
    asked = tmp_path / "scontrol-was-asked"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" > '{asked}'\nexit 1\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    code = main(["stacks", "--results-dir", str(tmp_path), "--", "-x"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "job_id '-x' is not a SLURM job ID" in err, err
    assert not asked.exists(), asked.read_text()
