"""Every key of madengine's examples/slurm-configs, honoured or refused by name (docs/madengine-configs.md): a config
of our own holding each key those files use, through job_spec, slurm_options and the rendered scripts; the job
script's module loading run with real bash; the collect job's own request."""

import json
import os
import subprocess
from pathlib import Path

import pytest

import slurm_multi
from plugins.filter.job_layout import node_workspace
from plugins.filter.run_context import restore_run_context
from slurm_multi.submission.sbatch import SlurmOptions, render_collect_script, render_job_script

ROOT = Path(__file__).resolve().parents[4]

# Every key madengine's examples/slurm-configs files use (basic/ and minimal/), with values of our own.
EVERY_KEY = {
    "_comment": "every key of madengine's slurm-configs",
    "_notes": {"modules": "loaded before the job"},
    "gpu_vendor": "AMD",
    "guest_os": "UBUNTU",
    "deploy": "slurm",
    "debug": False,
    "pre_scripts": [],
    "shared_data": "/shared/datasets",
    "slurm": {
        "partition": "gpu",
        "nodes": 2,
        "nodelist": "gpu[01-02]",
        "gpus_per_node": 8,
        "time": "04:00:00",
        "output_dir": "./slurm_results",
        "results_dir": "RESULTS",
        "shared_workspace": "WORKSPACE",
        "exclusive": True,
        "qos": "high",
        "account": "research",
        "network_interface": "ib0",
        "modules": ["rocm/6.2.0", "gcc/11.2.0"],
        "mem": "256G",
        "constraint": "MI300X",
        "enable_node_check": True,
        "auto_cleanup_nodes": False,
        "verbose_node_check": False,
        "_comment_node_check": "madengine's GPU-node preflight",
    },
    "distributed": {"launcher": "torchrun", "backend": "nccl", "nnodes": 2, "nproc_per_node": 8, "port": 29500},
    "env_vars": {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "16", "_comment_memory": "a comment inside env_vars"},
}


@pytest.fixture
def every_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_MULTI_RESULTS_DIR", raising=False)
    config = json.loads(json.dumps(EVERY_KEY))
    config["slurm"]["results_dir"] = str(tmp_path / "shared-results")
    config["slurm"]["shared_workspace"] = str(tmp_path / "workspace")
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps(config))
    spec = slurm_multi.job_spec(["dummy"], config=path, root=ROOT)
    return spec, slurm_multi.slurm_options(context=spec.additional_context)


def _sbatch_lines(script):
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def _job_script(slurm, tmp_path):
    return render_job_script(
        slurm, ROOT, Path("/venv/bin/ansible-playbook"), tmp_path / "vars.json", tmp_path, tmp_path
    )


def test_the_slurm_request_keys_become_sbatch_lines_mem_and_constraint_among_them(every_key, tmp_path):
    _, slurm = every_key
    lines = _sbatch_lines(_job_script(slurm, tmp_path))
    for line in ("--partition=gpu", "--nodes=2", "--nodelist=gpu[01-02]", "--gpus-per-node=8", "--time=04:00:00",
                 "--qos=high", "--account=research", "--mem=256G", "--constraint=MI300X", "--exclusive"):  # fmt: skip
        assert f"#SBATCH {line}" in lines


def test_a_memory_size_slurm_cannot_read_is_refused_before_anything_is_queued():
    with pytest.raises(slurm_multi.SlurmMultiError, match=r"--mem '256GB' \(slurm.mem\) is not a SLURM memory size"):
        slurm_multi.slurm_options(2, context={"slurm": {"mem": "256GB"}})


def test_results_dir_wins_over_output_dir_and_output_dir_alone_is_the_results_dir(every_key, tmp_path):
    spec, _ = every_key
    assert spec.results_dir == tmp_path / "shared-results"
    alone = slurm_multi.job_spec(["dummy"], config={"slurm": {"output_dir": "./slurm_results"}}, root=ROOT)
    assert alone.results_dir == tmp_path / "slurm_results"  # relative to where submit runs, as madengine's


def test_shared_workspace_holds_each_nodes_workspace_under_the_job_and_attempt(every_key, tmp_path):
    spec, _ = every_key
    run_context = restore_run_context({}, {}, spec.additional_context, {})
    workspace = node_workspace("/results/7/attempt-1/nodes/gpu01", "7", 1, "gpu01", run_context)
    assert workspace == str(tmp_path / "workspace" / "7" / "attempt-1" / "gpu01")
    assert node_workspace("/results/7/attempt-1/nodes/gpu01", "7", 1, "gpu01", {}) == (
        "/results/7/attempt-1/nodes/gpu01/workspace"
    )


def test_env_vars_and_network_interface_reach_the_container_under_docker_env_vars(every_key):
    spec, _ = every_key
    context = dict(spec.additional_context, docker_env_vars={"NCCL_DEBUG": "INFO"})
    variables = restore_run_context({}, {}, context, {})["docker_env_vars"]
    assert variables == {
        "NCCL_DEBUG": "INFO",  # docker_env_vars win over env_vars, as in madengine's container runner
        "OMP_NUM_THREADS": "16",
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "ib0",
    }


def test_network_interface_wins_over_env_vars_socket_interface_as_in_madengines_job_script():
    context = {"slurm": {"network_interface": "ib0"}, "env_vars": {"NCCL_SOCKET_IFNAME": "eth0"}}
    assert restore_run_context({}, {}, context, {})["docker_env_vars"]["NCCL_SOCKET_IFNAME"] == "ib0"


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"deploy": "k8s"}, "deploy is 'k8s': slurm-multi deploys on SLURM only"),
        ({"debug": True}, "debug is True: slurm-multi has no debug mode"),
        ({"pre_scripts": [{"path": "x.sh"}]}, "pre_scripts in the job's config are not run by slurm-multi"),
        ({"distributed": {"port": 29500, "master_port": 29501}}, "distributed.port 29500 and distributed.master_port"),
    ],
)
def test_values_that_ask_for_what_slurm_multi_does_not_do_are_refused_by_name(tmp_path, monkeypatch, config, refusal):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(slurm_multi.SlurmMultiError, match=refusal.replace("(", r"\(")):
        slurm_multi.job_spec(["dummy"], config=config, root=ROOT, results_dir=tmp_path / "r")


def test_master_port_is_the_launchers_port():
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import distributed_from_dict

    assert distributed_from_dict({"launcher": "megatron", "master_port": 29600}).port == 29600


# --- slurm.modules: loaded by the job script before the pipeline, with real bash -------------------------------


@pytest.fixture
def modules_script(tmp_path):
    """The job script of a job loading two modules; its ansible-playbook a stand-in logging its calls."""
    playbook = tmp_path / "ansible-playbook"
    playbook.write_text('#!/bin/bash\necho "playbook $(basename "$1")" >> "$CALLS"\n')
    playbook.chmod(0o755)
    (tmp_path / "playbooks").mkdir()
    script = tmp_path / "job.sbatch"
    slurm = SlurmOptions(nodes=1, modules=("rocm/6.2.0", "gcc/11.2.0"))
    script.write_text(render_job_script(slurm, tmp_path, playbook, tmp_path / "vars.json", tmp_path, tmp_path / "r"))
    return script, tmp_path / "calls"


def _env_without_module(calls):
    env = {name: value for name, value in os.environ.items() if not name.startswith("BASH_FUNC_module")}
    return dict(env, CALLS=str(calls))


def test_the_modules_are_loaded_in_order_before_the_pipeline(modules_script):
    script, calls = modules_script
    # How sites hand the `module` function to batch jobs: exported through the environment.
    env = dict(_env_without_module(calls), **{"BASH_FUNC_module%%": '() {  echo "module $*" >> "$CALLS"\n}'})
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert calls.read_text().splitlines()[:3] == [
        "module load rocm/6.2.0",
        "module load gcc/11.2.0",
        "playbook run_multi.yml",
    ]


@pytest.mark.skipif(
    any(Path(p).exists() for p in ("/etc/profile.d/lmod.sh", "/etc/profile.d/modules.sh")),
    reason="this machine has environment modules",
)
def test_a_node_without_module_ends_the_job_with_a_clear_error_before_the_pipeline(modules_script):
    script, calls = modules_script
    result = subprocess.run(
        ["bash", str(script)], env=_env_without_module(calls), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "slurm.modules asks for rocm/6.2.0 gcc/11.2.0, but this node has no 'module' command" in result.stderr
    assert not calls.exists()


def test_a_module_that_fails_to_load_ends_the_job_naming_it(modules_script):
    script, calls = modules_script
    env = dict(_env_without_module(calls), **{"BASH_FUNC_module%%": "() {  return 1\n}"})
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "'module load rocm/6.2.0' failed (slurm.modules)" in result.stderr
    assert not calls.exists()


def test_a_job_without_modules_loads_none():
    script = render_job_script(SlurmOptions(nodes=1), ROOT, Path("/p"), Path("/v.json"), Path("/o"), Path("/r"))
    assert "module load" not in script


# --- the collect job's own request --------------------------------------------------------------------------------


def _collect_lines(slurm):
    return _sbatch_lines(render_collect_script(slurm, "4242", Path("/venv/bin/python"), Path("/v.json"), Path("/o")))


def test_the_collect_job_asks_for_no_gpus_no_memory_and_a_short_time_by_default(every_key):
    _, slurm = every_key
    lines = _collect_lines(slurm)
    assert "#SBATCH --time=00:15:00" in lines and "#SBATCH --nodes=1" in lines
    assert not [line for line in lines if line.startswith(("#SBATCH --gpus", "#SBATCH --mem", "#SBATCH --exclusive"))]
    assert "#SBATCH --partition=gpu" in lines  # the job's partition unless collect_job_partition says otherwise


def test_the_collect_jobs_settings_give_its_own_partition_account_qos_time_and_gpus(every_key):
    _, slurm = every_key
    slurm = slurm.with_collect_job(
        {
            "collect_job_partition": "cpu",
            "collect_job_account": "ops",
            "collect_job_qos": "low",
            "collect_job_time": "5",
            "collect_job_gpus": 1,
        }  # fmt: skip
    )
    lines = _collect_lines(slurm)
    for line in ("--partition=cpu", "--account=ops", "--qos=low", "--time=5", "--gpus-per-node=1"):
        assert f"#SBATCH {line}" in lines
    # The job's nodes' constraint does not name the collect partition's nodes.
    assert "#SBATCH --constraint=MI300X" not in lines
    assert "#SBATCH --partition=gpu" in _sbatch_lines(_job_script(slurm, Path("/o")))


def test_the_collect_jobs_settings_reach_the_scripts_from_e(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = slurm_multi.job_spec(
        ["dummy"], results_dir=tmp_path / "r", root=ROOT, extra_vars=["collect_job_partition=debug"]
    )
    plan = slurm_multi.plan_submission(spec, slurm_multi.slurm_options(2, partition="gpu"), root=ROOT)
    assert "#SBATCH --partition=debug" in _sbatch_lines(plan.collect_script)
    assert "#SBATCH --partition=gpu" in _sbatch_lines(plan.job_script)


def test_a_collect_job_gpu_request_slurm_cannot_read_is_refused():
    with pytest.raises(Exception, match="collect_job_gpus 'all' must be a count"):
        render_collect_script(
            SlurmOptions(nodes=2).with_collect_job({"collect_job_gpus": "all"}), "1", Path("/p"), Path("/v"), Path("/o")
        )
