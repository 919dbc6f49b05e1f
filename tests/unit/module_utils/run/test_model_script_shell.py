"""The shell a model's `.sh` script runs under: bash, as madengine runs it (`bash run.sh`), else sh with a warning.

The command the container runs (model_run_spec.model_command) is run here as a real process on this machine, whose
/bin/sh is dash as on Debian and Ubuntu bases: a script of bash's own features fails under dash.
"""

import os
import shutil
import subprocess

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import model_command

# madengine's dummy card prints `performance: $RANDOM samples_per_second`; MAD's scripts use the rest.
BASH_ONLY_SCRIPT = """set -o pipefail
steps=(warmup measure)
[[ ${#steps[@]} == 2 ]] || exit 3
source ./common.sh
echo "performance: $((RANDOM + 1)) samples_per_second ${steps[1]} $COMMON $1"
"""


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "run.sh").write_text(BASH_ONLY_SCRIPT)
    (tmp_path / "common.sh").write_text("COMMON=sourced\n")
    return tmp_path


def run(argv, cwd, path=None):
    env = dict(os.environ, PATH=path or os.environ["PATH"])
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=20)


@pytest.mark.skipif(os.path.realpath("/bin/sh").endswith("bash"), reason="needs a /bin/sh that is not bash (dash)")
def test_a_sh_script_runs_under_bash_as_madengine_runs_it(workspace):
    result = run(model_command("run.sh", "'a b'"), workspace)
    assert result.returncode == 0, result.stderr
    label, figure, rest = result.stdout.split(" ", 2)
    assert (label, rest) == ("performance:", "samples_per_second measure sourced a b\n")
    assert int(figure) > 0 and result.stderr == ""


def test_the_script_and_its_args_stay_argv_never_shell_code(workspace):
    (workspace / "args.sh").write_text('printf "%s|" "$@"\n')
    args = ["$(touch pwned)", "`id`", "a;b", "${HOME}", "'q'"]
    result = run(model_command("args.sh", args, image="$(touch pwned2)"), workspace)
    assert result.stdout == "|".join(args) + "|"
    assert not (workspace / "pwned").exists() and not (workspace / "pwned2").exists()


def test_a_base_without_bash_runs_the_script_under_sh_and_says_so_naming_the_image(workspace, tmp_path_factory):
    # An image like the lab's busybox samples: sh and the usual tools, no bash.
    bin_dir = tmp_path_factory.mktemp("bin")
    for tool in ("sh", "printf", "echo"):
        target = shutil.which(tool)
        if target:
            (bin_dir / tool).symlink_to(target)
    (workspace / "plain.sh").write_text('echo "performance: 7 samples_per_second"\n')
    result = run(model_command("plain.sh", image="slurm-multi-lab/busybox"), workspace, path=str(bin_dir))
    assert result.returncode == 0 and result.stdout == "performance: 7 samples_per_second\n"
    assert result.stderr == (
        "slurm-multi: image slurm-multi-lab/busybox has no bash; running plain.sh under sh "
        "(madengine runs a .sh script with bash)\n"
    )
