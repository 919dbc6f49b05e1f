"""Mount de-duplication against the user's `additional_docker_run_options`, in every spelling docker accepts."""

import json

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.docker_mounts import mount_args, mount_targets


@pytest.mark.parametrize(
    "options, target",
    [
        (["-v", "/host/data:/data"], "/data"),
        (["-v/host/data:/data"], "/data"),
        (["-v=/host/data:/data"], "/data"),
        (["-itv", "/host/data:/data"], "/data"),
        (["--volume", "/host/data:/data:ro"], "/data"),
        (["--volume=/host/data:/data:ro,z"], "/data"),
        (["-v", "hf-cache:/root/.cache"], "/root/.cache"),
        (["-v", "/scratch"], "/scratch"),
        (["--mount", "type=bind,source=/host/data,target=/data"], "/data"),
        (["--mount", "type=bind,src=/host/data,dst=/data,readonly"], "/data"),
        (["--mount=type=volume,source=models,destination=/models"], "/models"),
        (["--mount", 'type=bind,"source=/host/a,b",Target=/data'], "/data"),
        (["--tmpfs", "/run:rw,size=64m"], "/run"),
        (["--tmpfs=/tmp"], "/tmp"),
    ],
)
def test_every_spelling_of_a_mount_names_its_container_path(options, target):
    assert mount_targets(options) == {target}


@pytest.mark.parametrize(
    "written, normalized",
    [
        ("/data/", "/data"),
        ("/data//sets/", "/data/sets"),
        ("//data", "/data"),
        ("/data/./sets", "/data/sets"),
    ],
)
def test_container_paths_are_normalized(written, normalized):
    assert mount_targets(["-v", f"/host:{written}"]) == {normalized}


def test_a_string_of_options_is_split_like_a_shell_would():
    options = "--ipc=host -v '/host/my data:/data' --mount type=bind,src=/m,dst=/models --shm-size 16G"
    assert mount_targets(options) == {"/data", "/models"}


def test_options_that_only_look_like_mounts_are_not_mounts():
    options = ["--volumes-from", "other", "--volume-driver", "local", "-e", "ARGS=-v /x:/y", "--env=-v", "-it"]
    assert mount_targets(options) == set()


def test_no_options_mount_nothing():
    assert mount_targets(None) == set() and mount_targets("") == set() and mount_targets([]) == set()


@pytest.mark.parametrize(
    "options, problem",
    [
        (["-v"], "-v at the end of the docker options has no value"),
        (["--mount"], "--mount at the end of the docker options has no value"),
        (["--volume="], "--volume=: the --volume option has an empty value"),
        (["-v="], "-v=: the -v option has an empty value"),
        (["-v", "data"], "-v 'data': the container path 'data' is not absolute"),
        (["-v", "/host:ro"], "-v '/host:ro': the container path 'ro' is not absolute"),
        (["-v", ":/data"], "-v ':/data': the host path or volume name is empty"),
        (["-v", "/a:/b:ro:z"], "-v '/a:/b:ro:z': too many ':'"),
        (["--volume", "/a:/b:"], "--volume '/a:/b:': the mode after the last ':' is empty"),
        (["--mount", "type=bind,src=/a"], "--mount 'type=bind,src=/a': no target"),
        (["--mount", "type=bind,dst=/a,target=/b"], "more than one target"),
        (["--mount", "type=bind,,dst=/a"], "--mount 'type=bind,,dst=/a': empty field"),
        (["--mount=dst=relative"], "the container path 'relative' is not absolute"),
        (["--tmpfs", "run"], "--tmpfs 'run': the container path 'run' is not absolute"),
        ("-v '/unclosed:/quote", "cannot be split"),
    ],
)
def test_malformed_mount_options_are_refused_naming_the_option(options, problem):
    with pytest.raises(ValueError) as error:
        mount_targets(options)
    assert problem in str(error.value)


def test_context_mounts_map_container_paths_to_host_paths():
    assert mount_args({"/data": "/shared/datasets", "/models": "/shared/models"}, []) == [
        "-v",
        "/shared/datasets:/data",
        "-v",
        "/shared/models:/models",
    ]


def test_a_mount_the_user_already_made_is_left_out():
    wanted = {"/data": "/shared/datasets", "/models": "/shared/models"}
    assert mount_args(wanted, ["--mount", "type=bind,src=/mine,dst=/data/"]) == ["-v", "/shared/models:/models"]


def test_the_same_container_path_twice_among_the_wanted_mounts_is_mounted_once():
    assert mount_args(["/a:/data", "/b:/data/", "/c:/other:ro"], "") == ["-v", "/a:/data", "-v", "/c:/other:ro"]


@pytest.mark.parametrize(
    "mounts, problem",
    [
        ({"/data": ""}, "docker_mounts '/data': the host path is empty"),
        ({"/data": "/mnt/c:d"}, "a path with ':' cannot be given to -v"),
        ({"data": "/mnt"}, "the container path 'data' is not absolute"),
        ("/a:/data", "mounts must be a mapping {container path: host path} or a list"),
        ([["/a", "/data"]], "is not a 'host:container[:mode]' string"),
        (["/a:data"], "mount '/a:data': the container path 'data' is not absolute"),
    ],
)
def test_malformed_wanted_mounts_are_refused(mounts, problem):
    with pytest.raises(ValueError) as error:
        mount_args(mounts, [])
    assert problem in str(error.value)


def test_docker_refuses_a_duplicate_mount_point_and_accepts_the_deduplicated_arguments(
    private_dockerd, busybox_image, tmp_path
):
    tag, _ = busybox_image
    (tmp_path / "mine").mkdir()
    (tmp_path / "context").mkdir()
    user_options = ["--mount", f"type=bind,src={tmp_path / 'mine'},dst=/data/"]
    wanted = {"/data": str(tmp_path / "context"), "/results": str(tmp_path / "context")}

    naive = ["-v", f"{tmp_path / 'context'}:/data"]
    refused = private_dockerd.docker("create", *user_options, *naive, tag, "true", check=False)
    assert refused.returncode != 0 and "Duplicate mount point" in refused.stderr

    created = private_dockerd.docker("create", *user_options, *mount_args(wanted, user_options), tag, "true")
    container = created.stdout.strip()
    try:
        mounts = json.loads(private_dockerd.docker("inspect", "--format", "{{json .Mounts}}", container).stdout)
    finally:
        private_dockerd.docker("rm", "-f", container, check=False)
    assert {(mount["Destination"], mount["Source"]) for mount in mounts} == {
        ("/data", str(tmp_path / "mine")),
        ("/results", str(tmp_path / "context")),
    }
