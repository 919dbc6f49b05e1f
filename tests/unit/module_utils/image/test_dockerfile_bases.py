"""Which images a Dockerfile builds on, once its build args are substituted, and the record's base_docker."""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.dockerfile_bases import (
    DockerfileBaseError,
    base_docker,
    dockerfile_base_images,
    read_base_images,
)

MAD_STYLE = "# CONTEXT {'gpu_vendor': 'AMD'}\nARG BASE_DOCKER=rocm/pytorch:latest\nFROM $BASE_DOCKER\nRUN echo hi\n"


def test_mad_style_from_names_the_arg_default():
    bases = read_base_images(MAD_STYLE)
    assert (bases.references, bases.run_image_base) == (["rocm/pytorch:latest"], "rocm/pytorch:latest")


def test_a_build_arg_replaces_the_arg_default():
    bases = read_base_images(MAD_STYLE, {"BASE_DOCKER": "rocm/pytorch:rocm6.4"})
    assert bases.references == ["rocm/pytorch:rocm6.4"]


def test_braces_and_default_and_alternative_forms_are_substituted():
    text = (
        "ARG REPO=rocm/pytorch\nARG TAG\nARG SUFFIX\n"
        "FROM ${REPO}:${TAG:-latest} AS first\nFROM ${REPO}${SUFFIX:+-dev}:$TAG AS second\n"
    )
    assert read_base_images(text, {"SUFFIX": "x", "TAG": "v2"}).references == ["rocm/pytorch:v2", "rocm/pytorch-dev:v2"]
    assert read_base_images(text, {"TAG": ""}).references[0] == "rocm/pytorch:latest"


def test_a_default_may_itself_be_substituted():
    text = "ARG DEFAULT=ubuntu:22.04\nARG BASE\nFROM\t${BASE:-${DEFAULT}}\n"
    assert read_base_images(text).references == ["ubuntu:22.04"]


def test_an_arg_default_uses_the_args_declared_before_it():
    text = 'ARG VERSION=6.4\nARG BASE="rocm/pytorch:rocm${VERSION}"\nFROM $BASE\n'
    assert read_base_images(text, {"VERSION": "7.0"}).references == ["rocm/pytorch:rocm7.0"]


def test_a_build_arg_no_arg_declares_before_from_reaches_no_from_line():
    with pytest.raises(DockerfileBaseError, match=r"FROM \$BASE_DOCKER names no image: give its ARG a value"):
        read_base_images("FROM $BASE_DOCKER\nARG BASE_DOCKER\n", {"BASE_DOCKER": "ubuntu:22.04"})


def test_an_arg_after_the_first_from_does_not_change_a_later_from():
    text = "ARG BASE=ubuntu:22.04\nFROM $BASE AS one\nARG BASE=debian:12\nFROM $BASE\n"
    assert read_base_images(text).references == ["ubuntu:22.04"]


def test_every_from_image_counts_once_and_stages_and_scratch_are_not_images():
    text = (
        "FROM --platform=linux/amd64 golang:1.22 AS Build\nRUN go build\n"
        "FROM scratch AS empty\nFROM golang:1.22 AS again\n"
        "FROM rocm/pytorch:latest AS runtime\nCOPY --from=build /app /app\n"
        "FROM build\n"
    )
    bases = read_base_images(text)
    assert bases.references == ["golang:1.22", "rocm/pytorch:latest"]
    assert bases.run_image_base == "golang:1.22"  # the last stage is `build`'s, case aside


def test_from_scratch_alone_has_no_base_image():
    assert read_base_images("FROM scratch\nCOPY busybox /bin/busybox\n") == ([], "", {})


def test_continuation_lines_comments_and_the_escape_directive_are_read_as_docker_reads_them():
    text = "# escape=`\n\nARG BASE=a`\n# a comment inside\n:1\nFROM ${BASE}`\n AS x\n"
    assert read_base_images(text).references == ["a:1"]


def test_a_heredoc_body_holds_no_instruction():
    text = "FROM busybox:1\nRUN <<EOF\nFROM evil:1\nEOF\nCOPY <<-NOTE /n\n\tFROM evil:2\n\tNOTE\nFROM busybox:2\n"
    assert read_base_images(text).references == ["busybox:1", "busybox:2"]


def test_a_heredoc_marker_whose_end_never_comes_hides_no_from_line():
    text = "FROM busybox:1\nRUN cat <<EOF >/x\nFROM busybox:2\n"
    assert read_base_images(text).references == ["busybox:1", "busybox:2"]


def test_single_quotes_keep_a_dollar_and_the_escape_character_keeps_one_literal():
    assert read_base_images("ARG A='x$y'\nFROM $A\n").references == ["x$y"]
    assert read_base_images("ARG A=x\\$y\nFROM $A\n").references == ["x$y"]


def test_an_unknown_substitution_is_refused_naming_the_ones_known():
    with pytest.raises(DockerfileBaseError, match=r"knows \$\{NAME\}, \$\{NAME:-default\}"):
        read_base_images("ARG B=rocm/pytorch:latest\nFROM ${B%:*}\n")


def test_a_dockerfile_that_cannot_be_read_is_named(tmp_path):
    with pytest.raises(DockerfileBaseError, match=f"cannot read Dockerfile {tmp_path}/missing"):
        dockerfile_base_images(tmp_path / "missing")


# --- the record's base_docker: madengine's rule --------------------------------------------------------------------


def test_base_docker_prefers_the_build_arg():
    bases = read_base_images(MAD_STYLE, {"BASE_DOCKER": "rocm/pytorch:new"})
    assert base_docker(bases, {"BASE_DOCKER": "rocm/pytorch:new"}) == "rocm/pytorch:new"


def test_base_docker_falls_back_to_the_arg_default():
    assert base_docker(read_base_images(MAD_STYLE), {}) == "rocm/pytorch:latest"


def test_base_docker_without_a_base_docker_arg_is_the_run_images_base():
    text = "FROM --platform=linux/amd64 ubuntu:22.04 AS base\nFROM rocm/dev:1 AS tools\nFROM base\n"
    assert base_docker(read_base_images(text), {}) == "ubuntu:22.04"
