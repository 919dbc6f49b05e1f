"""MAD's launcher contract: golden cases, each the variables madengine's SLURM launcher gives for the same nodes,
GPUs and port (ROCm/madengine src/madengine/deployment/slurm.py `_generate_*_command` and
templates/slurm/job.sh.j2), and the refusals. Pure logic: no daemon, no lab."""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import (
    LauncherError,
    LaunchSite,
    canonical_launcher,
    distributed_from_dict,
    interface_of_address,
    launcher_environment,
    model_distributed,
    node_addresses_in_rank_order,
    route_interface,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRun,
    ModelRunError,
    docker_run_args,
    validate,
)
from slurm_multi.errors import SlurmMultiError
from slurm_multi.spec import job_spec
from slurm_multi.submission.sbatch import SlurmOptions
from slurm_multi.submission.submit import plan_submission

# madengine's job.sh.j2 for any launcher, on node rank 1 of 3, 8 GPUs, job 4242.
COMMON = {
    "MASTER_PORT": "29500",
    "RANK": "1",
    "WORLD_SIZE": "3",
    "NPROC_PER_NODE": "8",
    "GPUS_PER_NODE": "8",
    "LOCAL_RANK": "0",
    "MAD_DEPLOYMENT_TYPE": "slurm",
    "MAD_SLURM_JOB_ID": "4242",
    "MAD_NODE_RANK": "1",
    "MAD_TOTAL_NODES": "3",
    "MAD_COLLECT_METRICS": "false",
}
TORCHRUN_3 = "torchrun --nnodes=3 --nproc_per_node=8 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500"


def site(rank=1, nnodes=3, gpus=8, **extra):
    return LaunchSite(
        rank=rank, nnodes=nnodes, master_addr="10.0.0.1", master_port=29500, slurm_job_id="4242", gpus=gpus, **extra
    )


def env_of(launcher, at=None, **distributed):
    environment = launcher_environment(distributed_from_dict(dict(distributed, launcher=launcher)), at or site())
    return environment.identity, environment.defaults


@pytest.mark.parametrize(
    "launcher, runner, defaults",
    [
        ("torchrun", TORCHRUN_3, {}),
        (
            "megatron",
            TORCHRUN_3,
            {"TENSOR_MODEL_PARALLEL_SIZE": "8", "PIPELINE_MODEL_PARALLEL_SIZE": "3", "CONTEXT_PARALLEL_SIZE": "1"},
        ),
        (
            "torchtitan",
            TORCHRUN_3,
            {
                "TORCHTITAN_TENSOR_PARALLEL_SIZE": "8",
                "TORCHTITAN_PIPELINE_PARALLEL_SIZE": "3",
                "TORCHTITAN_FSDP_ENABLED": "1",
                "TORCHTITAN_CONTEXT_PARALLEL_SIZE": "1",
            },
        ),
    ],
)
def test_the_torch_family_gets_madengines_runner_and_parallel_sizes_on_three_nodes(launcher, runner, defaults):
    identity, given = env_of(launcher)
    assert identity == dict(COMMON, MAD_LAUNCHER_TYPE=canonical_launcher(launcher), MAD_MULTI_NODE_RUNNER=runner)
    assert given == dict(defaults, DISTRIBUTED_BACKEND="nccl", TORCH_ELASTIC_RDZV_TIMEOUT="3600")


def test_one_node_runs_torchrun_standalone_and_megatron_caps_its_tensor_parallel_size_at_8():
    identity, defaults = env_of("megatron-lm", site(rank=0, nnodes=1, gpus=16))
    assert identity["MAD_MULTI_NODE_RUNNER"] == "torchrun --standalone --nproc_per_node=16"
    assert identity["MAD_COLLECT_METRICS"] == "true" and identity["WORLD_SIZE"] == "1"
    assert (defaults["TENSOR_MODEL_PARALLEL_SIZE"], defaults["PIPELINE_MODEL_PARALLEL_SIZE"]) == ("8", "1")
    assert "TORCH_ELASTIC_RDZV_TIMEOUT" not in defaults  # madengine sets it for multi-node jobs only


def test_a_node_without_gpus_runs_one_process_and_nproc_per_node_overrides_the_gpu_count():
    assert env_of("torchrun", site(gpus=None))[0]["NPROC_PER_NODE"] == "1"
    assert env_of("torchrun", site(gpus=0))[0]["GPUS_PER_NODE"] == "1"
    identity, _ = env_of("torchrun", nproc_per_node=2, port=30000)
    assert identity["MAD_MULTI_NODE_RUNNER"] == (
        "torchrun --nnodes=3 --nproc_per_node=2 --node_rank=1 --master_addr=10.0.0.1 --master_port=30000"
    )
    assert identity["MASTER_PORT"] == "30000"


def test_deepspeed_gets_a_hostfile_of_every_node_and_its_runner():
    environment = launcher_environment(
        distributed_from_dict({"launcher": "deepspeed"}), site(node_names=["gpu1", "gpu2", "gpu3"])
    )
    assert environment.identity["MAD_MULTI_NODE_RUNNER"] == (
        "deepspeed --hostfile=/slurm-multi/deepspeed-hostfile --master_addr=10.0.0.1 --master_port=29500"
    )
    assert environment.workspace_files == {"deepspeed-hostfile": "gpu1 slots=8\ngpu2 slots=8\ngpu3 slots=8\n"}
    single = launcher_environment(distributed_from_dict({"launcher": "deepspeed"}), site(rank=0, nnodes=1))
    assert single.identity["MAD_MULTI_NODE_RUNNER"] == "deepspeed --num_gpus=8" and not single.workspace_files


@pytest.mark.parametrize(
    "launcher, nnodes, expected",
    [
        (
            "vllm",
            3,
            {"VLLM_TENSOR_PARALLEL_SIZE": "8", "VLLM_PIPELINE_PARALLEL_SIZE": "1", "VLLM_DISTRIBUTED_BACKEND": "none"},
        ),
        (
            "vllm",
            1,
            {"VLLM_TENSOR_PARALLEL_SIZE": "8", "VLLM_PIPELINE_PARALLEL_SIZE": "1", "VLLM_DISTRIBUTED_BACKEND": "auto"},
        ),
        ("sglang", 3, {"SGLANG_TENSOR_PARALLEL_SIZE": "8", "SGLANG_PIPELINE_PARALLEL_SIZE": "1"}),
    ],
)
def test_vllm_and_sglang_get_their_parallel_sizes_and_no_runner(launcher, nnodes, expected):
    identity, defaults = env_of(launcher, site(rank=0, nnodes=nnodes))
    assert "MAD_MULTI_NODE_RUNNER" not in identity
    assert {name: defaults[name] for name in expected} == expected


def test_sglang_disagg_gets_the_node_list_and_madengines_default_split():
    ips = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
    identity, defaults = env_of("sglang_disagg", site(rank=2, nnodes=5, node_addresses=ips))
    assert {name: value for name, value in identity.items() if name.startswith("SGLANG_")} == {
        "SGLANG_DISAGG_MODE": "enabled",
        "SGLANG_DISAGG_PREFILL_NODES": "1",  # max(1, (5 - 1) * 2 // 5)
        "SGLANG_DISAGG_DECODE_NODES": "3",
        "SGLANG_DISAGG_TOTAL_NODES": "5",
        "SGLANG_NODE_IPS": ",".join(ips),
        "SGLANG_NODE_RANK": "2",
    }
    assert identity["MAD_LAUNCHER_TYPE"] == "sglang-disagg" and defaults["SGLANG_TP_SIZE"] == "8"
    custom, _ = env_of(
        "sglang-disagg", site(nnodes=5, node_addresses=ips), sglang_disagg={"prefill_nodes": 2, "decode_nodes": 2}
    )
    assert (custom["SGLANG_DISAGG_PREFILL_NODES"], custom["SGLANG_DISAGG_DECODE_NODES"]) == ("2", "2")


def test_sglang_disagg_refuses_fewer_than_three_nodes_and_a_split_that_does_not_add_up():
    with pytest.raises(LauncherError, match="needs at least 3 nodes .* the job has 2"):
        distributed_from_dict({"launcher": "sglang-disagg"}, nnodes=2)
    with pytest.raises(
        LauncherError, match=r"prefill_nodes \(2\) \+ decode_nodes \(2\) \+ 1 proxy must equal the job's 4"
    ):
        distributed_from_dict(
            {"launcher": "sglang-disagg", "sglang_disagg": {"prefill_nodes": 2, "decode_nodes": 2}}, 4
        )


def test_primus_gets_its_config_path_and_the_backend_its_model_name_implies():
    _, defaults = env_of("primus", site(model="primus_pretrain/torchtitan_MI300X_qwen3_4B-pretrain"))
    assert (defaults["PRIMUS_CONFIG_PATH"], defaults["BACKEND"]) == ("exp_pretrain.yaml", "torchtitan")
    _, given = env_of(
        "primus", primus={"config_path": "examples/megatron/llama.yaml", "cli_extra": "--x 1", "backend": "megatron"}
    )
    assert (given["PRIMUS_CONFIG_PATH"], given["PRIMUS_CLI_EXTRA"], given["BACKEND"]) == (
        "examples/megatron/llama.yaml",
        "--x 1",
        "megatron",
    )
    assert "MAD_MULTI_NODE_RUNNER" not in env_of("primus")[0]


def test_no_launcher_gives_nothing_beyond_todays_topology():
    for name in (None, "", "slurm_multi", "slurm-multi"):
        assert env_of(name) == ({}, {})


def test_every_madengine_name_and_alias_is_accepted_and_an_unknown_one_names_the_closest():
    assert [canonical_launcher(n) for n in ("torchrun", "DeepSpeed", "megatron", "megatron-lm", "megatron_lm")] == [
        "torchrun",
        "deepspeed",
        "megatron-lm",
        "megatron-lm",
        "megatron-lm",
    ]
    assert [canonical_launcher(n) for n in ("torchtitan", "primus", "vllm", "sglang", "sglang-disagg")] == [
        "torchtitan",
        "primus",
        "vllm",
        "sglang",
        "sglang-disagg",
    ]
    with pytest.raises(LauncherError, match=r"unknown launcher 'torchrn' \(did you mean 'torchrun'\?\)"):
        canonical_launcher("torchrn")
    with pytest.raises(LauncherError, match="not a int"):
        canonical_launcher(3)


def test_the_jobs_config_wins_over_the_cards_distributed_section_key_by_key():
    card = {
        "name": "m",
        "distributed": {"launcher": "torchrun", "nproc_per_node": 4, "sglang_disagg": {"prefill_nodes": 1}},
    }
    merged = model_distributed(card, {"distributed": {"nproc_per_node": 2}})
    assert (merged.launcher, merged.nproc_per_node, merged.prefill_nodes) == ("torchrun", 2, 1)
    with pytest.raises(LauncherError, match="the job's config: distributed must be an object"):
        model_distributed(card, {"distributed": "torchrun"})
    with pytest.raises(LauncherError, match="distributed.nproc_per_node must be a whole number of at least 1, not '2'"):
        model_distributed(card, {"distributed": {"nproc_per_node": "2"}})
    with pytest.raises(LauncherError, match="distributed.nnodes 4 differs from the job's 3 nodes"):
        model_distributed(card, {"distributed": {"nnodes": 4}}, nnodes=3)


def test_node_addresses_come_from_the_site_config_else_the_name_and_a_node_without_one_is_named():
    resolved = {"n2": ["10.0.0.2"], "n3": []}
    addresses, missing = node_addresses_in_rank_order(["n1", "n2", "n3"], {"n1": "10.0.0.1"}, lambda n: resolved[n])
    assert (addresses, missing) == (["10.0.0.1", "10.0.0.2"], ["n3"])


def test_the_socket_interface_is_the_one_carrying_the_route_to_master_addr():
    assert route_interface("127.0.0.11") == "lo" and interface_of_address("127.0.0.1") == "lo"
    assert interface_of_address("203.0.113.77") is None  # held by no interface here


# --- in the container's docker run ------------------------------------------------------------------------------


def model_run(tmp_path, **overrides):
    (tmp_path / "run.sh").write_text("true\n")
    options = dict(
        job_id="4242",
        rank=1,
        nnodes=3,
        node="node2",
        model="m",
        image="img",
        model_dir=str(tmp_path),
        script="run.sh",
        results_dir=str(tmp_path / "results"),
        master_addr="127.0.0.11",
        master_port=29500,
        user="tester",
        environ={"SLURM_JOB_ID": "4242"},
    )
    options.update(overrides)
    return ModelRun(**options)


def env_args(argv):
    return dict(argv[i + 1].split("=", 1) for i, arg in enumerate(argv) if arg == "-e")


def test_the_container_gets_the_launchers_variables_and_the_users_tunables_win_but_not_their_identity(tmp_path):
    run = model_run(
        tmp_path,
        distributed={"launcher": "torchrun"},
        docker_env_vars={"NCCL_SOCKET_IFNAME": "ib0", "RANK": "7", "TORCH_ELASTIC_RDZV_TIMEOUT": "60"},
    )
    given = env_args(docker_run_args(run, "/env-file"))
    assert given["MAD_MULTI_NODE_RUNNER"] == (
        "torchrun --nnodes=3 --nproc_per_node=1 --node_rank=1 --master_addr=127.0.0.11 --master_port=29500"
    )
    assert (given["RANK"], given["NODE_RANK"], given["GLOO_SOCKET_IFNAME"]) == ("1", "1", "lo")
    # Set by the user, so left to the env file (which -e would override): theirs stands.
    assert "NCCL_SOCKET_IFNAME" not in given and "TORCH_ELASTIC_RDZV_TIMEOUT" not in given
    # Without a launcher: the pipeline's topology and what madengine gives every container (below).
    assert set(env_args(docker_run_args(model_run(tmp_path), None))) == {
        "MASTER_ADDR",
        "MASTER_PORT",
        "NNODES",
        "NODE_RANK",
        "MAD_MODEL_NAME",
        "JENKINS_BUILD_NUMBER",
        "MAD_GUEST_OS",
        "MIOPEN_USER_DB_PATH",
    }


def test_sglang_disagg_on_the_node_reads_the_site_configs_addresses_in_rank_order(tmp_path):
    nodes = ["node1", "node2", "node3"]
    addresses = {"node1": "127.0.0.11", "node2": "127.0.0.12", "node3": "127.0.0.13"}
    run = model_run(
        tmp_path, distributed={"launcher": "sglang-disagg"}, allocation_nodes=nodes, node_addresses=addresses
    )
    assert env_args(docker_run_args(run, None))["SGLANG_NODE_IPS"] == "127.0.0.11,127.0.0.12,127.0.0.13"
    # localhost resolves to loopback only, which another node cannot reach: named, not passed on.
    missing = model_run(
        tmp_path,
        distributed={"launcher": "sglang-disagg"},
        allocation_nodes=nodes + ["localhost"],
        node_addresses=addresses,
        nnodes=4,
    )
    with pytest.raises(ModelRunError, match="but localhost resolve"):
        docker_run_args(missing, None)


def test_a_bad_distributed_section_fails_the_run_before_anything_starts(tmp_path):
    with pytest.raises(ModelRunError, match="model m: unknown launcher 'torchrunn'"):
        validate(model_run(tmp_path, distributed={"launcher": "torchrunn"}))


# --- before sbatch ------------------------------------------------------------------------------------------------


def test_a_card_with_sglang_disagg_on_two_nodes_is_refused_before_sbatch_naming_the_minimum(tmp_path):
    spec = job_spec(["dummy"], results_dir=tmp_path, additional_context={"distributed": {"launcher": "sglang-disagg"}})
    with pytest.raises(SlurmMultiError, match="model dummy: launcher sglang-disagg needs at least 3 nodes"):
        plan_submission(spec, SlurmOptions(nodes=2), private_dir=tmp_path / "p")
    assert "SGLANG" not in plan_submission(spec, SlurmOptions(nodes=3), private_dir=tmp_path / "p").job_script


def test_an_unknown_launcher_is_refused_when_the_job_is_specified(tmp_path):
    with pytest.raises(SlurmMultiError, match=r"model dummy: unknown launcher 'vlm' \(did you mean 'vllm'\?\)"):
        job_spec(["dummy"], results_dir=tmp_path, additional_context={"distributed": {"launcher": "vlm"}})


def test_the_rows_gpu_architecture_is_the_containers_first_gpus_arch_else_its_name(tmp_path):
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
        container_gpus,
        gpu_architecture,
    )

    mi250 = [{"index": 0, "arch": "gfx90a", "name": "AMD Instinct MI250X"}, {"index": 1, "arch": "gfx90a"}]
    run = model_run(tmp_path, gpu_vendor="AMD", gpus=mi250, environ={"SLURM_JOB_GPUS": "1"})
    assert [gpu["index"] for gpu in container_gpus(run)] == [1]
    assert gpu_architecture(container_gpus(run)) == "gfx90a"
    assert gpu_architecture([{"index": 0, "name": "NVIDIA A100-SXM4-80GB"}]) == "NVIDIA A100-SXM4-80GB"
    assert gpu_architecture([]) == "" and gpu_architecture(None) == ""


# --- what madengine gives every container, whatever the launcher -------------------------------------------------

MI300X = [{"index": index, "arch": "gfx942", "name": "AMD Instinct MI300X"} for index in range(8)]
# madengine's container_runner.run_container and core/context.py, for model m on node rank 1 of 3: an AMD node of 8
# GPUs of which the card's n_gpus=4 reach the container, a multiple_results CSV, CI's BUILD_NUMBER 17.
MADENGINE_EVERY_CONTAINER = {
    "MAD_MODEL_NAME": "m",
    "MAD_OUTPUT_CSV": "perf_m.csv",
    "JENKINS_BUILD_NUMBER": "17",
    "MAD_RUNTIME_NGPUS": "4",
    "MAD_GPU_VENDOR": "AMD",
    "MAD_SYSTEM_NGPUS": "8",
    "MAD_SYSTEM_GPU_ARCHITECTURE": "gfx942",
    "MAD_SYSTEM_GPU_PRODUCT_NAME": "AMD Instinct MI300X",
    "MAD_GUEST_OS": "UBUNTU",
    # The multi-node task script's, LOCAL_RANK left for the model's script to expand (job.sh.j2).
    "MIOPEN_USER_DB_PATH": "/tmp/.miopen/node_1_rank_${LOCAL_RANK:-0}",
    # Set whenever HIP_VISIBLE_DEVICES is: rocm/vllm images bake in 1, which makes Ray ignore it.
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "",
}


def amd_run(tmp_path, **overrides):
    options = dict(
        gpu_vendor="AMD",
        gpus=MI300X,
        n_gpus=4,
        multiple_results="perf_m.csv",
        environ={"SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "BUILD_NUMBER": "17"},
    )
    options.update(overrides)
    return model_run(tmp_path, **options)


@pytest.mark.parametrize("launcher", [None, "torchrun", "vllm"])
def test_every_container_gets_the_variables_madengine_sets_in_every_container(tmp_path, launcher):
    given = env_args(docker_run_args(amd_run(tmp_path, distributed={"launcher": launcher}), None))
    assert {name: given.get(name) for name in MADENGINE_EVERY_CONTAINER} == MADENGINE_EVERY_CONTAINER
    assert given["HIP_VISIBLE_DEVICES"] == "0,1,2,3"


def test_mad_runtime_ngpus_counts_the_gpus_the_container_gets_and_the_user_cannot_change_it(tmp_path):
    # n_gpus -1: all the allocation gives the node (madengine: every GPU it was given, `-1` resolved to their count).
    run = amd_run(tmp_path, n_gpus=-1, environ={"SLURM_JOB_GPUS": "2,5"}, docker_env_vars={"MAD_RUNTIME_NGPUS": "8"})
    given = env_args(docker_run_args(run, "/env-file"))
    assert (given["MAD_RUNTIME_NGPUS"], given["MAD_SYSTEM_NGPUS"]) == ("2", "8")


def test_the_users_docker_env_vars_win_over_madengines_context_values_as_in_madengine(tmp_path):
    run = amd_run(tmp_path, docker_env_vars={"MAD_GUEST_OS": "CENTOS", "MIOPEN_USER_DB_PATH": "/scratch/miopen"})
    given = env_args(docker_run_args(run, "/env-file"))
    # Left to the env file, where the user's value stands.
    assert "MAD_GUEST_OS" not in given and "MIOPEN_USER_DB_PATH" not in given
    assert given["MAD_MODEL_NAME"] == "m"


def test_a_node_without_gpus_says_it_has_none_and_names_no_vendor(tmp_path):
    given = env_args(docker_run_args(model_run(tmp_path, gpu_vendor="none", nnodes=1, rank=0), None))
    assert (given["MAD_RUNTIME_NGPUS"], given["MAD_SYSTEM_NGPUS"]) == ("0", "0")
    assert not {"MAD_GPU_VENDOR", "MAD_SYSTEM_GPU_ARCHITECTURE", "MAD_SYSTEM_GPU_PRODUCT_NAME"} & set(given)
    assert not {"MIOPEN_USER_DB_PATH", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "MAD_OUTPUT_CSV"} & set(given)
    assert (given["MAD_MODEL_NAME"], given["JENKINS_BUILD_NUMBER"], given["MAD_GUEST_OS"]) == ("m", "0", "UBUNTU")
