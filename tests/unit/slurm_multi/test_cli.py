"""The command line's side-effect-free entry points."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import slurm_multi

ROOT = Path(__file__).resolve().parents[3]


def _run_cli(args, cwd):
    env = dict(os.environ, HOME=str(cwd))
    return subprocess.run(
        [sys.executable, "-m", "slurm_multi.cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def _tree(path):
    return sorted(p.relative_to(path) for p in path.rglob("*"))


def test_version_prints_the_version_and_creates_nothing(tmp_path):
    result = _run_cli(["--version"], tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == f"slurm-multi {slurm_multi.__version__}"
    assert _tree(tmp_path) == []


def test_help_lists_the_commands_and_creates_nothing(tmp_path):
    result = _run_cli(["--help"], tmp_path)
    assert result.returncode == 0
    assert "lab" in result.stdout
    assert _tree(tmp_path) == []


def test_lab_rejects_an_unknown_action(tmp_path):
    result = _run_cli(["lab", "sideways"], tmp_path)
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_lab_pytorch_base_made_already_says_where_and_makes_nothing(tmp_path, monkeypatch, capsys):
    from slurm_multi import cli
    from slurm_multi.lab import pytorch

    made = tmp_path / "pytorch.tar"
    made.write_bytes(b"a root filesystem")
    monkeypatch.setattr(pytorch, "BASE_TAR", made)
    monkeypatch.setattr(pytorch, "_ensure_debootstrap", lambda progress: pytest.fail("it made the base again"))
    assert cli.main(["lab", "pytorch-base"]) == 0
    assert f"the PyTorch base: {made}" in capsys.readouterr().out
    assert _tree(tmp_path) == [Path("pytorch.tar")]


def test_submitting_imports_no_pandas_until_a_result_is_read():
    # pandas is 0.4 s of a login node's CPU at every `slurm-multi submit`; only a job's result (its perf rows) needs it.
    def pandas_imported(code):
        code = f"import sys; import slurm_multi, slurm_multi.cli; {code}; print('pandas' in sys.modules)"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    assert pandas_imported("pass") == "False"
    assert (
        pandas_imported("import slurm_multi.run_result; slurm_multi.run_result.job_result('/nonexistent', '1')")
        == "True"
    )
