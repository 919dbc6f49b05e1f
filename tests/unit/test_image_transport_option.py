"""`--image-transport` / `image_transport`: carried into the job's vars, bad values and combinations refused."""

import pytest

from slurm_multi import api
from slurm_multi.errors import SlurmMultiError
from tests.unit.test_cli_submit import _dry_run, _tree, _vars_of, cli  # noqa: F401 - the fixture

ROOT_TAGS = ["dummy"]


def test_the_stream_transport_reaches_the_job_vars(cli):  # noqa: F811
    assert _vars_of(_dry_run(cli, "--image-transport", "stream"))["image_transport"] == "stream"


def test_no_transport_given_keeps_group_vars_default(cli):  # noqa: F811
    assert "image_transport" not in _vars_of(_dry_run(cli))


def test_an_unknown_transport_is_refused_by_the_cli(cli, tmp_path):  # noqa: F811
    result = cli(["submit", "-N", "2", "--tags", "dummy", "--image-transport", "carrier-pigeon"])
    assert result.returncode == 2 and "invalid choice" in result.stderr
    assert _tree(tmp_path) == []


@pytest.mark.parametrize(
    "transport, registry, words",
    [
        ("registry", None, "give --registry too"),
        ("stream", "docker.io/org/repo", "drop one of them"),
        ("cache", "docker.io/org/repo", "drop one of them"),
        ("tarball", None, "none of cache, stream, registry"),
    ],
)
def test_the_api_refuses_a_transport_that_cannot_work(transport, registry, words, tmp_path):
    with pytest.raises(SlurmMultiError, match=words):
        api.job_spec(ROOT_TAGS, results_dir=tmp_path, registry=registry, image_transport=transport)


def test_the_api_carries_the_transport(tmp_path):
    spec = api.job_spec(ROOT_TAGS, results_dir=tmp_path, image_transport="stream")
    assert spec.image_transport == "stream" and spec.job_vars()["image_transport"] == "stream"


def test_submit_wait_shows_each_nodes_stream_bytes_and_rate_for_images_over_1_gb(tmp_path):
    import json

    from slurm_multi.submission.follow import image_stream_lines

    big = {"rank": 1, "node": "node2", "bytes": 1_500_000_000, "size_estimate": 2_000_000_000, "rate_mb_s": 150.2}
    (tmp_path / "image_stream.rank1.json").write_text(json.dumps(big))
    small = {"rank": 2, "node": "node3", "bytes": 1000, "size_estimate": 200_000_000, "rate_mb_s": 99.0}
    (tmp_path / "image_stream.rank2.json").write_text(json.dumps(small))
    shown = {}
    assert image_stream_lines([tmp_path], shown) == [
        "image stream on node2 (rank 1): streaming, 1.50 of ~2.00 GB, 150.2 MB/s"
    ]
    assert image_stream_lines([tmp_path], shown) == []  # nothing new
    (tmp_path / "image_stream.rank1.json").write_text(
        json.dumps(dict(big, bytes=2_000_000_000, done=True, action_taken="streamed"))
    )
    assert image_stream_lines([tmp_path], shown) == [
        "image stream on node2 (rank 1): done (streamed), 2.00 of ~2.00 GB, 150.2 MB/s"
    ]
