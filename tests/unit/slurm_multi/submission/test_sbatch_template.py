"""The sbatch scripts: SBATCH lines only for what is set, the reservation kept, quoting, and the script's behaviour.

The behaviour tests run the rendered script with real bash outside SLURM; a stand-in `ansible-playbook` logs its
calls, so the script's own logic (collect after any failure, the exit code, the early-warning trap) is what
they check.
"""

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm_multi.submission.sbatch import (
    PULL_NODE_SCRIPT,
    SbatchError,
    SlurmOptions,
    render_collect_script,
    render_job_script,
)

ROOT = Path("/opt/slurm multi/content")
PLAYBOOK = Path("/opt/venv/bin/ansible-playbook")
VARS = Path("/home/u/.slurm-multi/jobs/20250101-x/vars.json")
PRIVATE = VARS.parent
RESULTS = Path("/home/u/slurm-multi-results")


def _job(**options):
    return render_job_script(SlurmOptions(**{"nodes": 3, **options}), ROOT, PLAYBOOK, VARS, PRIVATE, RESULTS)


def _collect(**options):
    return render_collect_script(
        SlurmOptions(**{"nodes": 3, **options}), "4242", Path("/opt/venv/bin/python"), VARS, PRIVATE
    )


def _sbatch_lines(script):
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


@pytest.mark.parametrize(
    "option, value, line",
    [
        ("partition", "gpu", "#SBATCH --partition=gpu"),
        ("reservation", "bench-res", "#SBATCH --reservation=bench-res"),
        ("nodelist", "gpu[001-004,010]", "#SBATCH --nodelist=gpu[001-004,010]"),
        ("exclude", "gpu007", "#SBATCH --exclude=gpu007"),
        ("time", "1-12:00:00", "#SBATCH --time=1-12:00:00"),
        ("gpus_per_node", "mi300x:8", "#SBATCH --gpus-per-node=mi300x:8"),
        ("account", "research", "#SBATCH --account=research"),
        ("qos", "high", "#SBATCH --qos=high"),
    ],
)
def test_each_option_that_is_set_gets_its_sbatch_line(option, value, line):
    assert line in _sbatch_lines(_job(**{option: value}))


def test_options_not_set_get_no_sbatch_line():
    assert _sbatch_lines(_job()) == [
        "#SBATCH --job-name=slurm-multi",
        "#SBATCH --nodes=3",
        f'#SBATCH --output="{PRIVATE}/slurm-%j.out"',
        "#SBATCH --exclusive",
        "#SBATCH --signal=B:USR1@180",
    ]


def test_exclusive_is_the_default_and_can_be_turned_off():
    assert "#SBATCH --exclusive" in _sbatch_lines(_job())
    assert "#SBATCH --exclusive" not in _sbatch_lines(_job(exclusive=False))


def test_the_early_warning_signal_goes_to_the_batch_shell_before_the_time_limit():
    assert "#SBATCH --signal=B:USR1@300" in _sbatch_lines(_job(early_warning_seconds=300))


@pytest.mark.parametrize(
    "time_limit, seconds",
    [
        ("90", 5400),
        ("30:15", 1815),
        ("01:30:00", 5400),
        ("2-00", 172800),
        ("2-12:30", 217800),
        ("1-00:00:05", 86405),
        ("UNLIMITED", None),
    ],
)
def test_slurm_time_limits_are_read_in_seconds(time_limit, seconds):
    assert SlurmOptions(nodes=1, time=time_limit).time_limit_seconds() == seconds


def test_a_short_time_limit_gets_a_quarter_of_it_as_early_warning():
    # Warned 180 s ahead, a 2-minute job would be stopped the moment it starts.
    assert "#SBATCH --signal=B:USR1@30" in _sbatch_lines(_job(time="2"))


def test_a_long_time_limit_gets_the_full_early_warning():
    assert "#SBATCH --signal=B:USR1@180" in _sbatch_lines(_job(time="1-00:00:00"))


def test_the_pipeline_runs_with_one_fork_per_node_and_the_job_vars_file():
    script = _job(nodes=5)
    assert '"$ANSIBLE_PLAYBOOK" "$PLAYBOOKS/run_multi.yml" -f 5 -e "@$JOB_VARS"' in script
    assert '"$ANSIBLE_PLAYBOOK" "$PLAYBOOKS/collect.yml" -e "@$JOB_VARS"' in script


def test_the_script_exports_ansible_config_of_the_content_root_quoted_for_the_shell():
    line = next(line for line in _job().splitlines() if line.startswith("export ANSIBLE_CONFIG="))
    assert shlex.split(line.split("=", 1)[1]) == [str(ROOT / "ansible.cfg")]


def test_paths_with_shell_syntax_stay_literal_in_the_script(tmp_path):
    odd = tmp_path / "a b$(touch PWNED)'c"
    script = render_job_script(
        SlurmOptions(nodes=2), odd, odd / "ansible-playbook", odd / "vars.json", tmp_path, tmp_path / "results"
    )
    assignments = {
        line.split("=", 1)[0]: shlex.split(line.split("=", 1)[1])[0]
        for line in script.splitlines()
        if line.startswith(("ANSIBLE_PLAYBOOK=", "JOB_VARS="))
    }
    assert assignments == {"ANSIBLE_PLAYBOOK": str(odd / "ansible-playbook"), "JOB_VARS": str(odd / "vars.json")}


def test_the_job_script_is_valid_bash(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(_job(partition="gpu", reservation="r", time="90"))
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0


@pytest.mark.parametrize(
    "option, value",
    [
        ("partition", "gpu --uid=0"),
        ("reservation", "res\n#SBATCH --nodes=99"),
        ("account", 'a"b'),
        ("qos", "q#1"),
    ],
)
def test_a_value_that_could_smuggle_options_or_lines_is_refused_by_name(option, value):
    with pytest.raises(SbatchError, match=f"--{option}"):
        _job(**{option: value})


@pytest.mark.parametrize("value", ["90", "30:00", "01:30:00", "2-00", "2-12:00", "1-12:00:00", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(value):
    assert f"#SBATCH --time={value}" in _job(time=value)


@pytest.mark.parametrize("value", ["1h", "1:2:3:4", "tomorrow"])
def test_a_time_slurm_cannot_read_is_refused_with_the_formats(value):
    with pytest.raises(SbatchError, match=r"HH:MM:SS"):
        _job(time=value)


def test_a_node_count_below_one_is_refused():
    with pytest.raises(SbatchError, match="--nodes"):
        _job(nodes=0)


def test_a_percent_sign_in_the_output_path_is_escaped_for_sbatch():
    script = render_job_script(SlurmOptions(nodes=1), ROOT, PLAYBOOK, VARS, Path("/home/u/100%/job"), RESULTS)
    assert '#SBATCH --output="/home/u/100%%/job/slurm-%j.out"' in script


# --- the collect job ----------------------------------------------------------------------------------------------


def test_the_collect_job_runs_after_the_job_whatever_its_end_and_survives_its_cancel():
    lines = _sbatch_lines(_collect())
    assert "#SBATCH --dependency=afterany:4242" in lines
    assert "#SBATCH --kill-on-invalid-dep=no" in lines


def test_the_collect_job_keeps_partition_account_qos_and_reservation():
    lines = _sbatch_lines(_collect(partition="gpu", account="research", qos="high", reservation="bench-res"))
    for line in ("--partition=gpu", "--account=research", "--qos=high", "--reservation=bench-res"):
        assert f"#SBATCH {line}" in lines


def test_the_collect_job_is_one_short_shared_node_without_gpus_or_the_jobs_nodelist():
    lines = _sbatch_lines(_collect(nodelist="gpu[001-004]", gpus_per_node="8", time="2-00:00:00"))
    assert "#SBATCH --nodes=1" in lines
    assert "#SBATCH --time=00:15:00" in lines
    assert not [
        line
        for line in lines
        if line.startswith(("#SBATCH --exclusive", "#SBATCH --nodelist", "#SBATCH --gpus-per-node", "#SBATCH --signal"))
    ]


def test_the_collect_job_records_the_job_from_its_vars_file():
    command = _collect().splitlines()[-1]
    assert shlex.split(command) == [
        "exec",
        "/opt/venv/bin/python",
        "-m",
        "slurm_multi.cli",
        "collect",
        "4242",
        "--after-job",
        "--vars-file",
        str(VARS),
    ]


# --- the script's behaviour, with real bash -----------------------------------------------------------------------

STAND_IN_ANSIBLE_PLAYBOOK = """\
#!/bin/bash
# Logs each call; run_multi.yml exits with $PIPELINE_RC, or sleeps until TERM when PIPELINE_SLEEPS is set.
echo "$(basename "$1") $*" >> "$CALLS"
case "$1" in
  */run_multi.yml)
    if [ -n "${PIPELINE_WRITES_RECORD:-}" ]; then mkdir -p "$(dirname "$RECORD_FILE")"; echo '{}' > "$RECORD_FILE"; fi
    if [ -n "${PIPELINE_SLEEPS:-}" ]; then
      trap 'echo "pipeline got TERM" >> "$CALLS"; exit 143' TERM
      echo "$$" > "$PIPELINE_PID"
      sleep 60 & wait
    fi
    exit "${PIPELINE_RC:-0}" ;;
  */collect.yml)
    if [ -n "${COLLECT_SLOWLY:-}" ]; then touch "$COLLECTING"; sleep 2; echo "collect done" >> "$CALLS"; fi ;;
esac
"""


@pytest.fixture
def runnable_script(tmp_path):
    """A rendered job script whose ansible-playbook is a stand-in; returns (script, environment, calls file)."""
    root = tmp_path / "content"
    (root / "playbooks").mkdir(parents=True)
    stand_in = tmp_path / "ansible-playbook"
    stand_in.write_text(STAND_IN_ANSIBLE_PLAYBOOK)
    stand_in.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(
        render_job_script(SlurmOptions(nodes=2), root, stand_in, tmp_path / "vars.json", tmp_path, tmp_path / "results")
    )
    env = dict(
        os.environ,
        CALLS=str(tmp_path / "calls"),
        PIPELINE_PID=str(tmp_path / "pipeline.pid"),
        COLLECTING=str(tmp_path / "collecting"),
    )
    return script, env, tmp_path / "calls"


def _calls(path):
    return path.read_text().splitlines() if path.exists() else []


def test_collect_runs_after_a_failed_pipeline_and_the_script_exits_with_the_pipelines_code(runnable_script):
    script, env, calls = runnable_script
    result = subprocess.run(
        ["bash", str(script)], env=dict(env, PIPELINE_RC="3"), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 3
    assert [call.split()[0] for call in _calls(calls)] == ["run_multi.yml", "collect.yml"]


def test_collect_yml_is_not_started_again_when_the_pipeline_wrote_the_attempts_record(runnable_script, tmp_path):
    script, env, calls = runnable_script
    record = tmp_path / "results" / "records" / "4242" / "attempt-1.json"
    env = dict(env, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1", PIPELINE_WRITES_RECORD="1", RECORD_FILE=str(record))
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert [call.split()[0] for call in _calls(calls)] == ["run_multi.yml"]


def test_pull_mode_starts_one_step_of_one_ansible_playbook_per_node_then_collects_here():
    script = render_job_script(SlurmOptions(nodes=4), ROOT, PLAYBOOK, VARS, PRIVATE, RESULTS, "pull")
    step = next(line for line in script.splitlines() if "setsid " in line)
    argv = shlex.split(step.split("setsid ", 1)[1].rstrip("&").strip())
    # srun runs under pull_step.py, which gives the step its run nonce and ends it when a node is lost.
    assert argv[:5] == [sys.executable, "-m", "slurm_multi.pull_step", str(VARS), "--"]
    argv = argv[5:]
    assert argv[:7] == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        "--overlap",
        "--label",
    ]
    # Each node's task is pull_node.py (it adds the node's --limit), which outlives the playbook when SLURM stops
    # the job, until the run module is done.
    assert argv[7:] == [
        sys.executable,
        str(PULL_NODE_SCRIPT),
        str(PLAYBOOK),
        str(ROOT / "playbooks" / "run_multi.yml"),
        "-e",
        f"@{VARS}",
        "-e",
        '{"mode": "pull", "ansible_connection": "local"}',
    ]
    # Postprocessing once, here, its verdict the job's exit code; no token in argv.
    assert '"$ANSIBLE_PLAYBOOK" "$PLAYBOOKS/collect.yml" -e "@$JOB_VARS"\ncollect_rc=$?' in script
    assert "MAD_BARRIER_TOKEN" not in " ".join(argv)


def test_an_unknown_mode_is_refused():
    with pytest.raises(SbatchError, match="neither push nor pull"):
        render_job_script(SlurmOptions(nodes=2), ROOT, PLAYBOOK, VARS, PRIVATE, RESULTS, "pul")


def test_a_successful_pipeline_exits_zero_after_collecting(runnable_script):
    script, env, calls = runnable_script
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert _calls(calls)[-1].startswith("collect.yml")


def test_the_secrets_of_a_resubmitting_shell_do_not_reach_ansible(runnable_script, tmp_path):
    script, env, calls = runnable_script
    (tmp_path / "ansible-playbook").write_text('#!/bin/bash\nenv >> "$CALLS"\n')
    subprocess.run(["bash", str(script)], env=dict(env, MAD_SECRETS_HFTOKEN="hf_leak"), timeout=30)
    assert "hf_leak" not in calls.read_text()
    assert "CALLS=" in calls.read_text()


def test_the_early_warning_stops_the_pipeline_then_collects(runnable_script, tmp_path):
    script, env, calls = runnable_script
    job = subprocess.Popen(["bash", str(script)], env=dict(env, PIPELINE_SLEEPS="1"), stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "pipeline.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)
        output, _ = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143
    assert [call.split()[0] for call in _calls(calls)] == ["run_multi.yml", "pipeline", "collect.yml"]
    assert "early warning (SIGUSR1)" in output


def _wait_for(path):
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_term_after_the_early_warning_does_not_cut_collecting_short(runnable_script, tmp_path):
    script, env, calls = runnable_script
    job = subprocess.Popen(
        ["bash", str(script)], env=dict(env, PIPELINE_SLEEPS="1", COLLECT_SLOWLY="1"), stdout=subprocess.DEVNULL
    )
    try:
        _wait_for(tmp_path / "pipeline.pid")
        job.send_signal(signal.SIGUSR1)
        _wait_for(tmp_path / "collecting")
        job.send_signal(signal.SIGTERM)  # the time limit, while collect.yml runs
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143
    assert _calls(calls)[-1] == "collect done"


def test_the_early_warning_reaches_the_pipelines_whole_process_group(runnable_script, tmp_path):
    script, env, calls = runnable_script
    # The pipeline's child (a module process, an srun step) must get TERM too, not only ansible-playbook.
    (tmp_path / "ansible-playbook").write_text(
        textwrap.dedent("""\
        #!/bin/bash
        case "$1" in */run_multi.yml)
          bash -c 'trap "echo child got TERM >> $CALLS; exit 0" TERM; echo $$ > $PIPELINE_PID; sleep 60 & wait' &
          wait; wait ;;
        esac
        """)
    )
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "pipeline.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert "child got TERM" in _calls(calls)


def test_the_slurm_options_are_madengines_slurm_keys():
    # One list of the option names (module_utils/job/deployment_config.py): SlurmOptions has a field for each.
    from dataclasses import fields

    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.deployment_config import SLURM_REQUEST_KEYS

    assert set(SLURM_REQUEST_KEYS) <= {field.name for field in fields(SlurmOptions)}
