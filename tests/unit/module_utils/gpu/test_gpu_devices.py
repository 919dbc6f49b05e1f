"""GPU devices for the container: SLURM's GPU variables, the docker run arguments and the container's GPU variables.

The docker tests create (never start) containers on the session's private daemon and read back what Docker
understood from the arguments.
"""

import json
import os

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.devices import (
    allocated_gpu_indices,
    device_group_ids,
    docker_gpu_args,
    gpu_env,
    select_gpus,
)


def gpu(index, render_node=None):
    return {
        "index": index,
        "name": "AMD Instinct MI300X",
        "uuid": None,
        "pci_bus": None,
        "arch": "gfx942",
        "render_node": render_node,
        "mig_devices": [],
    }


# Render nodes out of index order, as on a node whose iGPU or BMC display took renderD128.
EIGHT_GPUS = [gpu(index, 129 + index) for index in range(8)]
AMD_ONLY_FLAGS = ["--group-add", "video", "--security-opt", "seccomp=unconfined"]


# --- SLURM's GPU variables -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, indices",
    [
        ("0", [0]),
        ("0,2", [0, 2]),
        ("0-3", [0, 1, 2, 3]),
        ("4-5,0,7", [0, 4, 5, 7]),
        ("3,1", [1, 3]),
    ],
)
def test_slurm_job_gpus_lists_and_ranges_give_sorted_indices(value, indices):
    assert allocated_gpu_indices({"SLURM_JOB_GPUS": value}) == indices


def test_the_step_gpus_win_over_the_job_gpus():
    assert allocated_gpu_indices({"SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "0-3"}) == [2]


def test_no_slurm_gpu_variable_means_no_gpu_allocation():
    assert allocated_gpu_indices({"SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "0"}) is None


def test_an_empty_step_variable_falls_back_to_the_job_variable():
    assert allocated_gpu_indices({"SLURM_STEP_GPUS": "", "SLURM_JOB_GPUS": "1"}) == [1]


@pytest.mark.parametrize(
    "value, problem",
    [
        ("gpu0", "'gpu0' is not a GPU index or range"),
        ("0,,1", "'' is not a GPU index or range"),
        ("0, 1", "' 1' is not a GPU index or range"),
        ("-1", "'-1' is not a GPU index or range"),
        ("3-1", "the range '3-1' runs backwards"),
        ("0-2,1", "GPU 1 is listed twice"),
        ("0-99999999", "99999999 is not a plausible GPU index"),
        ("NoDevFiles", "set File= for them in gres.conf"),
    ],
)
def test_a_malformed_slurm_gpu_list_is_refused_naming_variable_and_value(value, problem):
    with pytest.raises(ValueError) as error:
        allocated_gpu_indices({"SLURM_STEP_GPUS": value})
    assert str(error.value).startswith(f"SLURM_STEP_GPUS={value!r}: ")
    assert problem in str(error.value)


# --- docker run arguments --------------------------------------------------------------------------------------


def test_amd_container_gets_kfd_and_only_the_allocated_render_nodes():
    assert (
        docker_gpu_args("AMD", [1, 6], EIGHT_GPUS)
        == [
            "--device",
            "/dev/kfd",
            "--device",
            "/dev/dri/renderD130",
            "--device",
            "/dev/dri/renderD135",
        ]
        + AMD_ONLY_FLAGS
    )


def test_an_amd_gpu_without_a_known_render_node_gets_128_plus_its_index():
    assert (
        docker_gpu_args("AMD", [0, 3], [gpu(0), gpu(1), gpu(2), gpu(3)])
        == [
            "--device",
            "/dev/kfd",
            "--device",
            "/dev/dri/renderD128",
            "--device",
            "/dev/dri/renderD131",
        ]
        + AMD_ONLY_FLAGS
    )


def test_without_a_slurm_gpu_allocation_the_container_gets_every_gpu_of_the_node():
    args = docker_gpu_args("AMD", None, EIGHT_GPUS)
    assert [arg for arg in args if arg.startswith("/dev/dri/")] == [f"/dev/dri/renderD{129 + i}" for i in range(8)]


def test_nvidia_devices_are_one_quoted_csv_value_after_gpus():
    assert docker_gpu_args("NVIDIA", [0, 2], [gpu(0), gpu(1), gpu(2)]) == ["--gpus", '"device=0,2"']


def test_vendor_none_gives_no_arguments_even_with_an_allocation():
    assert docker_gpu_args("none", [0, 1], []) == []


def test_the_vendor_is_case_insensitive():
    assert docker_gpu_args("nvidia", [1], [gpu(0), gpu(1)]) == ["--gpus", '"device=1"']


def test_an_allocated_gpu_the_node_lacks_is_refused_naming_it_and_the_nodes_gpus():
    with pytest.raises(ValueError) as error:
        docker_gpu_args("AMD", [0, 128], [gpu(0), gpu(1)])
    assert str(error.value).startswith("SLURM allocated GPU(s) 128, which this node does not have (its GPUs: 0, 1)")


def test_an_unknown_vendor_is_refused():
    with pytest.raises(ValueError, match="GPU vendor 'Intel' is not one of AMD, NVIDIA, none"):
        docker_gpu_args("Intel", None, [])


def test_select_gpus_returns_the_allocations_records_in_index_order():
    assert [record["index"] for record in select_gpus([5, 2], EIGHT_GPUS)] == [2, 5]


# --- the container's GPU variables -----------------------------------------------------------------------------


def test_amd_container_numbers_its_gpus_from_zero():
    assert gpu_env("AMD", [1, 6]) == {"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0,1"}


def test_nvidia_runtime_gets_host_indices_and_cuda_counts_from_zero():
    assert gpu_env("NVIDIA", [2, 5, 7]) == {"NVIDIA_VISIBLE_DEVICES": "2,5,7", "CUDA_VISIBLE_DEVICES": "0,1,2"}


def test_nvidia_container_without_gpus_asks_the_runtime_for_none():
    assert gpu_env("NVIDIA", []) == {"NVIDIA_VISIBLE_DEVICES": "void"}


def test_no_allocation_or_no_vendor_sets_no_gpu_variables():
    assert gpu_env("AMD", None) == {} and gpu_env("none", [0]) == {}


# --- what Docker makes of the arguments ------------------------------------------------------------------------


def created_host_config(dockerd, image, args):
    """HostConfig of a container created (not started) with `args`; removed afterwards."""
    created = dockerd.docker("create", *args, image, "true", check=False)
    assert created.returncode == 0, created.stderr
    container = created.stdout.strip()
    try:
        return json.loads(dockerd.docker("inspect", "--format", "{{json .HostConfig}}", container).stdout)
    finally:
        dockerd.docker("rm", "-f", container, check=False)


def test_docker_reads_the_nvidia_argument_as_two_device_ids(private_dockerd, busybox_image):
    tag, _ = busybox_image
    args = docker_gpu_args("NVIDIA", [0, 2], [gpu(0), gpu(1), gpu(2)])
    [request] = created_host_config(private_dockerd, tag, args)["DeviceRequests"]
    assert request["DeviceIDs"] == ["0", "2"] and request["Count"] == 0


def test_docker_misreads_unquoted_device_lists_which_is_why_they_are_quoted(private_dockerd, busybox_image):
    tag, _ = busybox_image
    [request] = created_host_config(private_dockerd, tag, ["--gpus", "device=0,2"])["DeviceRequests"]
    assert request["DeviceIDs"] == ["0"] and request["Count"] == 2


def test_docker_accepts_the_amd_arguments_as_devices_group_and_security_option(private_dockerd, busybox_image):
    tag, _ = busybox_image
    config = created_host_config(private_dockerd, tag, docker_gpu_args("AMD", [1, 6], EIGHT_GPUS))
    assert [device["PathOnHost"] for device in config["Devices"]] == [
        "/dev/kfd",
        "/dev/dri/renderD130",
        "/dev/dri/renderD135",
    ]
    assert config["GroupAdd"] == ["video"] and config["SecurityOpt"] == ["seccomp=unconfined"]


def test_the_render_devices_group_is_added_by_number_and_roots_is_not(tmp_path):
    kfd, render, missing = tmp_path / "kfd", tmp_path / "renderD128", tmp_path / "renderD129"
    kfd.touch()
    render.touch()
    os.chown(render, -1, 4321)  # an image need not know the host's render group by name

    assert device_group_ids([str(kfd), str(render), str(missing)]) == [4321]
