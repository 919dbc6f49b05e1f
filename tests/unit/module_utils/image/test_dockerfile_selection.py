"""Choosing a model card's Dockerfiles by their # CONTEXT line, as MAD does; build args and build context."""

import os
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.dockerfile_selection import (
    DockerfileSelectionError,
    build_args_from_context,
    build_context_dir,
    candidate_dockerfiles,
    context_fits,
    read_dockerfile_context,
    select_dockerfiles,
)

FIXTURE_ZOO = Path(__file__).resolve().parents[3] / "fixtures" / "model_zoo"
DUMMY = {"name": "dummy", "dockerfile": "docker/dummy"}


def names(paths):
    return [os.path.basename(path) for path in paths]


@pytest.fixture
def zoo(tmp_path):
    (tmp_path / "docker").mkdir()
    return tmp_path


def write_dockerfile(zoo, name, text):
    path = zoo / "docker" / name
    path.write_text(text)
    return path


# --- the CONTEXT line --------------------------------------------------------------------------------------------


def test_reads_single_quoted_context_dict():
    assert read_dockerfile_context(FIXTURE_ZOO / "docker" / "dummy.ubuntu.amd.Dockerfile") == {
        "gpu_vendor": "AMD",
        "guest_os": "UBUNTU",
    }


def test_dockerfile_without_context_line_has_empty_context(zoo):
    assert read_dockerfile_context(write_dockerfile(zoo, "x.Dockerfile", "FROM scratch\n")) == {}


def test_context_line_after_the_first_five_lines_is_ignored(zoo):
    path = write_dockerfile(zoo, "x.Dockerfile", "#\n" * 5 + "# CONTEXT {'gpu_vendor': 'AMD'}\nFROM scratch\n")
    assert read_dockerfile_context(path) == {}


def test_malformed_context_line_names_file_and_line(zoo):
    path = write_dockerfile(zoo, "x.Dockerfile", "# comment\n# CONTEXT {'gpu_vendor': AMD}\nFROM scratch\n")
    with pytest.raises(DockerfileSelectionError, match=rf"{path}, line 2: the CONTEXT line is not a dict literal"):
        read_dockerfile_context(path)


def test_context_line_is_never_executed(zoo):
    path = write_dockerfile(zoo, "x.Dockerfile", "# CONTEXT __import__('os').system('touch /tmp/x')\n")
    with pytest.raises(DockerfileSelectionError, match="not a dict literal"):
        read_dockerfile_context(path)


def test_context_that_is_not_a_dict_is_refused(zoo):
    path = write_dockerfile(zoo, "x.Dockerfile", "# CONTEXT ['AMD']\n")
    with pytest.raises(DockerfileSelectionError, match="must hold a dict, not a list"):
        read_dockerfile_context(path)


# --- fitting the run context -------------------------------------------------------------------------------------


def test_context_fits_when_shared_keys_are_equal():
    assert context_fits({"gpu_vendor": "AMD", "guest_os": "UBUNTU"}, {"gpu_vendor": "AMD", "guest_os": "UBUNTU"})


def test_context_does_not_fit_when_a_shared_key_differs():
    assert not context_fits({"gpu_vendor": "NVIDIA"}, {"gpu_vendor": "AMD"})


def test_key_missing_from_the_run_context_does_not_filter():
    assert context_fits({"guest_os": "CENTOS"}, {"gpu_vendor": "AMD"})


def test_selects_the_dockerfile_of_the_run_gpu_vendor():
    chosen = select_dockerfiles(FIXTURE_ZOO, DUMMY, {"gpu_vendor": "NVIDIA", "guest_os": "UBUNTU"})
    assert names(chosen) == ["dummy.ubuntu.nvidia.Dockerfile"]


def test_selected_paths_are_absolute():
    chosen = select_dockerfiles(os.path.relpath(FIXTURE_ZOO), DUMMY, {"gpu_vendor": "AMD"})
    assert os.path.isabs(chosen[0])


def test_several_fitting_dockerfiles_are_all_selected_in_sorted_order():
    chosen = select_dockerfiles(FIXTURE_ZOO, DUMMY, {"guest_os": "UBUNTU"})
    assert names(chosen) == ["dummy.ubuntu.amd.Dockerfile", "dummy.ubuntu.nvidia.Dockerfile"]


def test_no_fitting_dockerfile_names_candidates_and_their_contexts():
    with pytest.raises(DockerfileSelectionError) as error:
        select_dockerfiles(FIXTURE_ZOO, DUMMY, {"gpu_vendor": "INTEL"})
    message = str(error.value)
    assert "no Dockerfile fits the run context {'gpu_vendor': 'INTEL'}" in message
    assert "docker/dummy.ubuntu.amd.Dockerfile {'gpu_vendor': 'AMD', 'guest_os': 'UBUNTU'}" in message
    assert "docker/dummy.ubuntu.nvidia.Dockerfile {'gpu_vendor': 'NVIDIA'" in message


def test_no_dockerfile_for_the_prefix_is_an_error_naming_the_prefix(zoo):
    with pytest.raises(DockerfileSelectionError, match=r"no Dockerfile matches docker/missing\.\*Dockerfile"):
        select_dockerfiles(zoo, {"name": "missing", "dockerfile": "docker/missing"}, {})


def test_card_without_dockerfile_is_an_error(zoo):
    with pytest.raises(DockerfileSelectionError, match="model 'x' has no 'dockerfile'"):
        select_dockerfiles(zoo, {"name": "x"}, {})


def test_only_files_ending_in_dockerfile_are_candidates(zoo):
    write_dockerfile(zoo, "m.ubuntu.amd.Dockerfile", "FROM scratch\n")
    write_dockerfile(zoo, "m.ubuntu.amd.Dockerfile.orig", "FROM scratch\n")
    write_dockerfile(zoo, "m.README", "")
    assert names(candidate_dockerfiles(zoo, "docker/m")) == ["m.ubuntu.amd.Dockerfile"]


def test_prefix_does_not_match_a_longer_model_name():
    assert "dummy_build_args.ubuntu.amd.Dockerfile" not in names(candidate_dockerfiles(FIXTURE_ZOO, "docker/dummy"))


def test_prefix_naming_a_file_is_that_file(zoo):
    (zoo / "scripts" / "kv").mkdir(parents=True)
    (zoo / "scripts" / "kv" / "Dockerfile").write_text("FROM scratch\n")
    assert names(candidate_dockerfiles(zoo, "scripts/kv/Dockerfile")) == ["Dockerfile"]


def test_glob_characters_in_the_prefix_are_literal(zoo):
    write_dockerfile(zoo, "m[1].amd.Dockerfile", "FROM scratch\n")
    write_dockerfile(zoo, "m1.amd.Dockerfile", "FROM scratch\n")
    assert names(candidate_dockerfiles(zoo, "docker/m[1]")) == ["m[1].amd.Dockerfile"]


# --- build context, build args, base image -----------------------------------------------------------------------


def test_build_context_is_the_zoos_docker_dir():
    assert build_context_dir(FIXTURE_ZOO, DUMMY) == str(FIXTURE_ZOO / "docker")


def test_build_context_is_the_cards_dockercontext_when_set():
    card = dict(DUMMY, dockercontext="scripts/dummy")
    assert build_context_dir(FIXTURE_ZOO, card) == str(FIXTURE_ZOO / "scripts" / "dummy")


def test_missing_build_context_is_an_error(zoo):
    with pytest.raises(DockerfileSelectionError, match="is not a directory"):
        build_context_dir(zoo, {"name": "x", "dockercontext": "nowhere"})


def test_build_args_come_from_docker_build_arg():
    assert build_args_from_context({"docker_build_arg": {"BASE_DOCKER": "rocm/pytorch", "JOBS": 8}}) == {
        "BASE_DOCKER": "rocm/pytorch",
        "JOBS": "8",
    }


def test_no_docker_build_arg_means_no_build_args():
    assert build_args_from_context({"gpu_vendor": "AMD"}) == {}


def test_build_arg_values_stay_literal():
    value = "x'; touch /tmp/pwned; '$(id)"
    assert build_args_from_context({"docker_build_arg": {"NOTE": value}}) == {"NOTE": value}


def test_build_arg_name_with_equals_sign_is_refused():
    with pytest.raises(DockerfileSelectionError, match="name 'A=B' is invalid"):
        build_args_from_context({"docker_build_arg": {"A=B": "1"}})


def test_non_scalar_build_arg_is_refused_naming_it():
    with pytest.raises(DockerfileSelectionError, match="docker_build_arg LIST must be a string or a number"):
        build_args_from_context({"docker_build_arg": {"LIST": ["a"]}})


def test_docker_build_arg_that_is_not_an_object_is_refused():
    with pytest.raises(DockerfileSelectionError, match="docker_build_arg must be an object"):
        build_args_from_context({"docker_build_arg": "BASE_DOCKER=x"})
