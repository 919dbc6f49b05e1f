"""The Python API on ansible-runner, with a stand-in content root: the real ansible-playbook, small playbooks.

The stand-in run_multi.yml writes one node's results as the run stage would; its collect.yml calls the real
collect_results module. What is under test is the API's part: extra vars that stay data, the private data dir,
secrets kept out of Ansible, events, the result object, stopping a run gently.
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

import slurm_multi
from slurm_multi.submission.job_vars import mark_unsafe, read_job_vars, unmark_unsafe, write_job_vars
from tests.support.ansible import ROOT, ansible_env, run_ansible

SECRET = "hf_api_value_that_must_not_leak"

RUN_MULTI = """\
- name: Stand-in pipeline
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Probe what the pipeline is given, then write the node's results as the run stage does
      ansible.builtin.shell: |
        printf '%s' "$GIVEN" > "$PROBE_DIR/given.json"
        env > "$PROBE_DIR/module_env"
        runner_dir="$(dirname "$(dirname "$AWX_ISOLATED_DATA_DIR")")"
        stat -c %a "$runner_dir" > "$PROBE_DIR/runner_dir_mode"
        cp -r "$runner_dir" "$PROBE_DIR/runner_dir_copy"
        if [ -n "$SECRETS_FILE" ]; then stat -c %a "$SECRETS_FILE" > "$PROBE_DIR/secrets_mode"; fi
        mkdir -p "$NODE_DIR"
        echo "performance: 42.5 samples_per_second" > "$NODE_DIR/run.log"
        printf '%s' "$STATUS" > "$NODE_DIR/status.json"
      environment:
        GIVEN: "{{ given | to_json }}"
        SECRETS_FILE: "{{ secrets_file | default('') }}"
        NODE_DIR: "{{ results_dir }}/{{ job_id }}/attempt-0/nodes/node1"
        STATUS: "{{ status | to_json }}"
      vars:
        given:
          additional_context: "{{ additional_context }}"
          model_tags: "{{ model_tags }}"
          job_id: "{{ job_id }}"
          secrets_file: "{{ secrets_file | default('') }}"
          secret_in_env: "{{ lookup('env', 'MAD_SECRETS_HFTOKEN') }}"
          runner_dir: "{{ lookup('env', 'AWX_ISOLATED_DATA_DIR') }}"
          playbook_command: "{{ lookup('file', '/proc/self/cmdline') }}"
        status: {node: node1, rank: 0, nnodes: 1, status: "{{ node_status | default('SUCCESS') }}",
                 exit_code: "{{ node_exit_code | default(0) }}", perf_lines: 1, reason: ""}
"""

COLLECT = """\
- name: Stand-in postprocessing
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Collect
      collect_results:
        results_dir: "{{ results_dir }}"
        job_id: "{{ collect_job_id }}"
        attempt: "{{ collect_attempt | default(omit) }}"
        model: {name: dummy}
        nodes: "{{ collect_nodes }}"
"""

SLEEPER = """\
- name: A pipeline that waits to be stopped
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Wait like a running model
      ansible.builtin.shell: |
        trap 'echo stopped > "$PROBE_DIR/term"; exit 0' TERM
        touch "$PROBE_DIR/started"
        sleep 60 & wait
"""


def _stand_in_root(base: Path) -> Path:
    root = base / "content"
    (root / "playbooks").mkdir(parents=True)
    (root / "ansible.cfg").write_text(
        textwrap.dedent(f"""\
        [defaults]
        inventory = ./hosts
        library = {ROOT / "library"}
        collections_path = {ROOT / "collections"}
        gathering = explicit
        retry_files_enabled = false
        callback_plugins = ./plugins/callback
        callbacks_enabled = preload_plugins
        """)
    )
    shutil.copytree(ROOT / "plugins" / "callback", root / "plugins" / "callback")
    (root / "hosts").write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    (root / "playbooks" / "run_multi.yml").write_text(RUN_MULTI)
    (root / "playbooks" / "collect.yml").write_text(COLLECT)
    (base / "probe").mkdir()
    (base / "home").mkdir()
    return root


def _isolate(monkeypatch, base: Path) -> None:
    monkeypatch.setenv("HOME", str(base / "home"))
    monkeypatch.setenv("PROBE_DIR", str(base / "probe"))
    for name in [name for name in os.environ if name.startswith(("SLURM_", "MAD_SECRETS_"))]:
        monkeypatch.delenv(name)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A content root with stand-in playbooks; HOME, PROBE_DIR and the results dir under tmp_path."""
    root = _stand_in_root(tmp_path)
    _isolate(monkeypatch, tmp_path)
    return root, tmp_path / "probe", slurm_multi.job_spec(["dummy"], results_dir=tmp_path / "results", root=ROOT)


CONTEXT = {"docker_env_vars": {"ARGS": "{{ lookup('pipe', 'echo PWNED') }} $(id) `id`"}, "n": 3}


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory):
    """One run of the stand-in pipeline with a secret in the environment and template syntax in the context.

    Returns (result, probe dir, events, spec). Ansible runs cost seconds: the tests below share this one.
    """
    base = tmp_path_factory.mktemp("completed-run")
    root = _stand_in_root(base)
    events = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        _isolate(monkeypatch, base)
        monkeypatch.setenv("MAD_SECRETS_HFTOKEN", SECRET)
        spec = slurm_multi.job_spec(["dummy"], results_dir=base / "results", additional_context=CONTEXT, root=ROOT)
        result = slurm_multi.run(spec, job_id="4242", root=root, on_event=events.append)
    return result, base / "probe", events, spec


def _given(probe):
    return json.loads((probe / "given.json").read_text())


def test_run_starts_slurm_multi_playbook_as_the_job_script_does(completed_run):
    _, probe, _, _ = completed_run
    command = _given(probe)["playbook_command"].split("\0")
    assert command[1] == str(Path(sys.executable).parent / "slurm-multi-playbook"), command


def test_run_returns_the_recorded_verdict_per_node_verdicts_and_perf_rows(completed_run):
    result, _, _, spec = completed_run
    assert (result.status, result.rc, result.recorded) == ("SUCCESS", 0, True)
    assert result.per_node["node1"]["status"] == "SUCCESS"
    assert isinstance(result.perf, pd.DataFrame)
    assert result.perf[["model", "performance", "metric"]].values.tolist() == [["dummy", "42.5", "samples_per_second"]]
    assert result.record_json == spec.results_dir / "records" / "4242.json"
    assert result.record_csv.is_file() and result.job_dir.is_dir()


def test_ansible_cfgs_callbacks_load_under_ansible_runner(completed_run):
    # ansible-runner's own ANSIBLE_CALLBACK_PLUGINS hid ansible.cfg's callback dir: a warning on every run.
    _, _, events, _ = completed_run
    warnings = [event["stdout"] for event in events if "callback" in event.get("stdout", "").lower()]
    assert not [line for line in warnings if "Skipping callback plugin" in line], warnings


def test_template_syntax_in_user_values_reaches_ansible_as_literal_text(completed_run):
    _, probe, _, _ = completed_run
    assert _given(probe)["additional_context"] == CONTEXT


def test_plain_strings_of_an_extra_vars_file_would_be_templated(tmp_path):
    # Why every string is marked unsafe: ansible-core 2.19 trusts `-e @file` strings as templates.
    vars_file = tmp_path / "plain.json"
    vars_file.write_text(json.dumps({"value": "{{ 6 * 7 }}"}))
    result = run_ansible(
        ["ansible", "localhost", "-m", "ansible.builtin.debug", "-a", "var=value", "-e", f"@{vars_file}"],
        env=ansible_env(),
    )
    assert "value: 42" in result.stdout, result.stdout + result.stderr


def test_the_runners_private_data_dir_is_0700_during_the_run_and_gone_after(completed_run):
    _, probe, _, _ = completed_run
    assert (probe / "runner_dir_mode").read_text().strip() == "700"
    runner_dir = Path(_given(probe)["runner_dir"]).parent.parent
    assert runner_dir.name.startswith("slurm-multi-runner-")
    assert not runner_dir.exists()


def test_secrets_reach_the_pipeline_only_as_a_0600_file_removed_after_the_run(completed_run):
    _, probe, _, _ = completed_run
    given = _given(probe)
    assert given["secret_in_env"] == ""
    assert (probe / "secrets_mode").read_text().strip() == "600"
    assert "/.slurm-multi/jobs/" in given["secrets_file"]
    assert not Path(given["secrets_file"]).exists()


def test_no_secret_value_is_in_the_modules_environment(completed_run):
    _, probe, _, _ = completed_run
    environment = (probe / "module_env").read_text()
    assert "PROBE_DIR=" in environment
    assert SECRET not in environment


def test_no_secret_value_is_in_the_runners_artifacts(completed_run):
    _, probe, _, _ = completed_run
    copied = [path for path in (probe / "runner_dir_copy").rglob("*") if path.is_file()]
    assert any(path.name == "command" for path in copied)  # ansible-runner's copy of the environment
    assert not [path for path in copied if SECRET in path.read_text(errors="replace")]


def test_events_stream_through_the_callback(completed_run):
    _, _, events, _ = completed_run
    started = [event["event_data"].get("task") for event in events if event.get("event") == "playbook_on_task_start"]
    assert started == [
        "Probe what the pipeline is given, then write the node's results as the run stage does",
        "Collect",
    ]


def test_collecting_a_recorded_job_again_changes_nothing(completed_run):
    result, probe, _, spec = completed_run
    before = result.record_json.read_bytes()
    again = slurm_multi.collect("4242", spec.results_dir, root=probe.parent / "content")
    assert again.status == "SUCCESS"
    assert result.record_json.read_bytes() == before


def test_a_failed_node_makes_a_failure_result(stand_in):
    root, _, spec = stand_in
    spec = slurm_multi.JobSpec(**{**spec.__dict__, "extra_vars": {"node_status": "FAILURE", "node_exit_code": 3}})
    result = slurm_multi.run(spec, job_id="4243", root=root)
    assert (result.status, result.recorded) == ("FAILURE", True)
    assert "exited with code 3" in result.reason


def test_a_stop_request_terms_the_pipeline_so_its_processes_clean_up(stand_in):
    root, probe, spec = stand_in
    (root / "playbooks" / "run_multi.yml").write_text(SLEEPER)
    stop = threading.Event()

    def request_stop_once_started():
        deadline = time.monotonic() + 60
        while not (probe / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()

    threading.Thread(target=request_stop_once_started, daemon=True).start()
    # The caller's own child processes (a daemon of its own session, say) are not the pipeline's to stop.
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        result = slurm_multi.run(spec, job_id="4250", root=root, cancel=stop.is_set)
        assert bystander.poll() is None, "the stop request killed a process that was not the pipeline's"
    finally:
        bystander.kill()
        bystander.wait()
    assert (probe / "term").read_text().strip() == "stopped"
    assert (result.status, result.recorded) == ("FAILURE", True)  # collected after the stop
    assert result.rc != 0


def test_mark_unsafe_wraps_every_string_and_unmark_restores_the_value():
    value = {"a": ["x", 1, {"b": "{{ y }}"}], "c": None, "d": True}
    marked = mark_unsafe(value)
    assert marked == {"a": [{"__ansible_unsafe": "x"}, 1, {"b": {"__ansible_unsafe": "{{ y }}"}}], "c": None, "d": True}
    assert unmark_unsafe(marked) == value


def test_the_job_vars_file_is_private(tmp_path):
    path = tmp_path / "vars.json"
    write_job_vars(path, {"results_dir": "/r"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_job_vars(path) == {"results_dir": "/r"}


# ------------------------------------------------------------------------------------------ secrets at the door


@pytest.mark.parametrize(
    "context",
    [
        {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "hf_literal_value_in_context"}},
        {"docker_build_arg": {"MAD_SECRETS_HFTOKEN": "hf_literal_value_in_context"}},
        {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "prefix-${MAD_SECRETS_HFTOKEN}"}},
    ],
)
def test_a_literal_secret_in_the_additional_context_is_refused_saying_to_export_it(context):
    with pytest.raises(slurm_multi.SlurmMultiError) as raised:
        slurm_multi.job_spec(["dummy"], results_dir="/tmp/r", additional_context=json.dumps(context), root=ROOT)

    message = str(raised.value)
    (section,) = context
    assert f"gives {section}.MAD_SECRETS_HFTOKEN a literal value" in message
    assert "export MAD_SECRETS_HFTOKEN=..." in message
    assert "hf_literal_value_in_context" not in message


def test_a_secret_placeholder_in_the_additional_context_is_accepted():
    context = {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}", "HF_TOKEN": "$MAD_SECRETS_HF"}}

    spec = slurm_multi.job_spec(["dummy"], results_dir="/tmp/r", additional_context=context, root=ROOT)

    assert spec.additional_context == context


def test_a_secret_build_arg_is_refused_at_submit_saying_how_to_mount_it():
    context = {"docker_build_arg": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}"}}

    with pytest.raises(
        slurm_multi.SlurmMultiError,
        match=r"docker_build_arg MAD_SECRETS_HFTOKEN is a secret: .*"
        r"RUN --mount=type=secret,id=MAD_SECRETS_HFTOKEN",
    ):
        slurm_multi.job_spec(["dummy"], results_dir="/tmp/r", additional_context=context, root=ROOT)


def test_a_literal_secret_in_the_additional_context_file_is_refused_too(tmp_path):
    context_file = tmp_path / "context.json"
    context_file.write_text(json.dumps({"distributed": {"env": {"MAD_SECRETS_DB": "db_password_1"}}}))

    with pytest.raises(slurm_multi.SlurmMultiError, match=r"gives distributed\.env\.MAD_SECRETS_DB a literal value"):
        slurm_multi.job_spec(["dummy"], results_dir="/tmp/r", additional_context_file=context_file, root=ROOT)


def test_run_refuses_a_secret_shorter_than_8_characters_before_anything_runs(stand_in, monkeypatch):
    root, probe, spec = stand_in
    monkeypatch.setenv("MAD_SECRETS_PIN", "4242")

    with pytest.raises(
        slurm_multi.SlurmMultiError, match=r"MAD_SECRETS_PIN is 4 character\(s\) long, shorter than 8"
    ) as raised:
        slurm_multi.run(spec, job_id="4260", root=root)

    assert "4242" not in str(raised.value)
    assert not (probe / "given.json").exists()
    assert not (probe.parent / "home" / ".slurm-multi").exists()


def test_run_refuses_a_secret_holding_a_line_boundary(stand_in, monkeypatch):
    root, probe, spec = stand_in
    monkeypatch.setenv("MAD_SECRETS_PEM", f"{SECRET}\u2028MAD_SECRETS_OTHER=injected")

    with pytest.raises(slurm_multi.SlurmMultiError, match="value of MAD_SECRETS_PEM holds a line break") as raised:
        slurm_multi.run(spec, job_id="4261", root=root)

    assert SECRET not in str(raised.value)
    assert not (probe / "given.json").exists()


# ------------------------------------------------------------------------------------------ the package's public API

PUBLIC_NAMES = [
    "JobSpec",
    "RunResult",
    "SlurmMultiError",
    "SlurmOptions",
    "Submission",
    "SubmissionPlan",
    "collect",
    "default_results_dir",
    "job_spec",
    "plan_submission",
    "run",
    "slurm_options",
    "submit",
    "wait",
]


def test_star_import_gives_exactly_the_public_names():
    namespace = {}
    exec("from slurm_multi import *", namespace)

    assert sorted(name for name in namespace if name != "__builtins__") == sorted(slurm_multi.__all__) == PUBLIC_NAMES


def test_the_package_is_the_one_public_surface():
    # One list of names: no second module re-exports them.
    assert not (ROOT / "slurm_multi" / "api.py").exists()
    for name in PUBLIC_NAMES:
        assert getattr(slurm_multi, name).__module__.startswith("slurm_multi."), name


def test_importing_the_package_loads_neither_ansibles_engine_nor_pandas():
    # `slurm-multi --help` imports the package: the API's heavy imports wait until a name is used. Not even the
    # `ansible` package's shell is loaded (the seam to module_utils once did, 36 ms).
    heavy = "{'ansible', 'ansible.cli', 'ansible.executor', 'ansible.plugins.loader', 'ansible_runner', 'pandas'}"
    probe = f"import sys, slurm_multi; print(sorted({heavy} & set(sys.modules)))"
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]"


def test_the_public_names_plan_a_submission_from_a_job_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MAD_SECRETS_HFTOKEN", raising=False)
    spec = slurm_multi.job_spec("dummy", results_dir=tmp_path / "results")
    slurm = slurm_multi.slurm_options(2, partition="gpu")

    plan = slurm_multi.plan_submission(spec, slurm, private_dir=tmp_path / "job")

    assert isinstance(spec, slurm_multi.JobSpec) and isinstance(slurm, slurm_multi.SlurmOptions)
    assert isinstance(plan, slurm_multi.SubmissionPlan)
    assert "#SBATCH --nodes=2" in plan.job_script and "#SBATCH --partition=gpu" in plan.job_script
    assert plan.job_vars["model_tags"] == ["dummy"]
    assert not (tmp_path / "job").exists()


def test_bad_input_raises_the_public_error_type():
    with pytest.raises(slurm_multi.SlurmMultiError, match="no model tags given"):
        slurm_multi.job_spec([], results_dir="/tmp/r")


def test_the_default_results_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_MULTI_RESULTS_DIR", str(tmp_path / "shared-results"))
    assert slurm_multi.default_results_dir() == tmp_path / "shared-results"


def test_run_and_collect_return_the_public_result_type(completed_run):
    result, probe, _, spec = completed_run
    again = slurm_multi.collect("4242", spec.results_dir, root=probe.parent / "content")
    assert isinstance(result, slurm_multi.RunResult) and isinstance(again, slurm_multi.RunResult)


def test_the_docs_python_api_section_shows_the_public_names():
    readme = (ROOT / "docs" / "python-api.md").read_text()
    assert "## Python API\n" in readme
    section = readme.split("## Python API\n", 1)[1].split("\n## ", 1)[0]
    assert set(slurm_multi.__all__) <= set(re.findall(r"`(\w+)`", section))
    assert set(re.findall(r"slurm_multi\.(\w+)\(", section)) <= set(slurm_multi.__all__)


NOTHING_WRITTEN = """\
- name: A pipeline cut short before any node wrote its results
  hosts: localhost
  gather_facts: false
  tasks: []
"""


def test_a_sweep_models_run_that_left_no_record_is_collected_into_one(stand_in):
    root, _, spec = stand_in
    (root / "playbooks" / "run_multi.yml").write_text(NOTHING_WRITTEN)
    spec = slurm_multi.JobSpec(**{**spec.__dict__, "sweep": ({"name": "dummy"}, {"name": "dummy_lastrank"})})
    result = slurm_multi.run(spec, job_id="4260", root=root)
    assert result.recorded
    first = result.sweep[0]
    assert (first["job_id"], first["status"]) == ("4260.1", "FAILURE")
    assert (Path(spec.results_dir) / "records" / "4260.1.json").is_file()
