"""`--image-transport` / `image_transport`: carried into the job's vars, bad values and combinations refused."""

import pytest

import slurm_multi
from slurm_multi.errors import SlurmMultiError
from tests.unit.slurm_multi.test_cli_submit import _dry_run, _tree, _vars_of, cli  # noqa: F401 - the fixture

ROOT_TAGS = ["dummy"]


def test_the_registry_transport_reaches_the_job_vars(cli):  # noqa: F811
    vars_ = _vars_of(_dry_run(cli, "--image-transport", "registry", "--registry", "localhost:5000/repo"))
    assert vars_["image_transport"] == "registry"


def test_the_retired_stream_transport_is_refused_before_anything_is_queued(cli, tmp_path):  # noqa: F811
    result = cli(["submit", "-N", "2", "--tags", "dummy", "--image-transport", "stream"])
    assert result.returncode == 2
    assert "retired" in result.stderr and "cache" in result.stderr and "registry" in result.stderr
    assert _tree(tmp_path) == []


def test_the_retired_stream_transport_is_refused_from_extra_vars(cli, tmp_path):  # noqa: F811
    result = cli(["submit", "-N", "2", "--tags", "dummy", "-e", "image_transport=stream"])
    assert result.returncode == 2 and "retired" in result.stderr
    assert _tree(tmp_path) == []


def test_no_transport_given_keeps_group_vars_default(cli):  # noqa: F811
    assert "image_transport" not in _vars_of(_dry_run(cli))


def test_an_unknown_transport_is_refused_by_the_cli(cli, tmp_path):  # noqa: F811
    result = cli(["submit", "-N", "2", "--tags", "dummy", "--image-transport", "carrier-pigeon"])
    assert result.returncode == 2 and "none of cache, registry" in result.stderr
    assert _tree(tmp_path) == []


@pytest.mark.parametrize(
    "transport, registry, words",
    [
        ("registry", None, "give --registry too"),
        ("stream", None, "retired: use cache or registry"),
        ("cache", "docker.io/org/repo", "drop one of them"),
        ("tarball", None, "none of cache, registry"),
    ],
)
def test_the_api_refuses_a_transport_that_cannot_work(transport, registry, words, tmp_path):
    with pytest.raises(SlurmMultiError, match=words):
        slurm_multi.job_spec(ROOT_TAGS, results_dir=tmp_path, registry=registry, image_transport=transport)


def test_the_api_carries_the_transport(tmp_path):
    spec = slurm_multi.job_spec(ROOT_TAGS, results_dir=tmp_path, image_transport="cache")
    assert spec.image_transport == "cache" and spec.job_vars()["image_transport"] == "cache"


def test_a_speedup_that_is_neither_true_nor_false_is_refused_before_anything_is_queued(cli, tmp_path):  # noqa: F811
    result = cli(["submit", "-N", "2", "--tags", "dummy", "-e", "speedup=sometimes"])
    assert result.returncode == 2 and "speedup 'sometimes' is not true or false" in result.stderr
    assert _tree(tmp_path) == []


def test_speedup_false_reaches_the_job_vars(cli):  # noqa: F811
    assert _vars_of(_dry_run(cli, "-e", "speedup=false"))["speedup"] in (False, "false")
