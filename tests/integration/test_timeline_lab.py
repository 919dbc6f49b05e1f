"""Issue 19 on the lab, both modes: `submit --wait --follow` streams every rank's log lines while the job runs,
`logs JOB` shows the same lines afterwards, and a node made to load a large image alone is named the straggler of
the load step by `report --job`."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_submit_lab import _cli
from tests.support.lab_nodes import node_docker_host

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
NODES = ("node1", "node2", "node3")
LOG_LINE = re.compile(r"^(node\d+) r(\d+) \| (.*)$")

# 500 MB of random bytes (no compression helps): a node that must `docker load` it takes seconds, a node that
# holds the image takes a fraction of one.
BALLAST_DOCKERFILE = """# CONTEXT {'guest_os': 'UBUNTU'}
# A large image for the load-straggler lab test (tests/integration/test_timeline_lab.py).
ARG BASE_DOCKER=slurm-multi-lab/busybox:latest
FROM $BASE_DOCKER
RUN dd if=/dev/urandom of=/ballast bs=1M count=500
WORKDIR /myworkspace
"""


def _submit(tmp_path, results, *args, timeout=900):
    result = _cli(
        [
            "submit",
            "-N",
            "3",
            "--nodelist",
            "node[1-3]",
            "--no-exclusive",
            "--results-dir",
            str(results),
            "--wait",
            *args,
        ],
        tmp_path,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout.split("Submitted job ")[1].split()[0], result.stdout


def test_submit_follow_streams_every_rank_while_the_job_runs_and_logs_shows_the_same(
    lab_cluster, pipeline_mode, tmp_path
):
    results = tmp_path / "results"
    job_id, out = _submit(tmp_path, results, "--tags", "dummy_lastrank", "--follow")
    lines = out.splitlines()
    streamed = [line for line in lines if LOG_LINE.match(line)]
    for rank, node in enumerate(NODES):
        assert f"{node} r{rank} | rank {rank}/3 on {node}, master 127.0.0.11:" in "\n".join(streamed), out[-3000:]
    assert "node3 r2 | performance: 1.0123e+04 tokens/sec" in streamed
    # While the job ran: each rank's first line came before SLURM said the job was completing.
    ended = next(index for index, line in enumerate(lines) if re.search(rf"job {job_id}: COMPLET", line))
    for node in NODES:
        assert next(index for index, line in enumerate(lines) if line.startswith(f"{node} r")) < ended, out[-3000:]
    assert "\033[" not in out  # a pipe gets no colours

    logs = _cli(["logs", job_id, "--results-dir", str(results)], tmp_path)
    assert logs.returncode == 0, logs.stdout + logs.stderr
    assert sorted(logs.stdout.splitlines()) == sorted(streamed)
    only_rank2 = _cli(["logs", job_id, "--results-dir", str(results), "--rank", "2"], tmp_path)
    assert sorted(only_rank2.stdout.splitlines()) == sorted(line for line in streamed if line.startswith("node3 r2 |"))


def test_logs_follow_started_with_the_job_streams_every_rank_and_ends_with_it(lab_cluster, pipeline_mode, tmp_path):
    results = tmp_path / "results"
    submitted = _cli(
        ["submit", "-N", "3", "--nodelist", "node[1-3]", "--no-exclusive", "--tags", "dummy_lastrank"]
        + ["--results-dir", str(results)],
        tmp_path,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split("Submitted job ")[1].split()[0]
    # Started before any node has written a line (the job is pending or preparing): it waits, then ends by itself
    # once SLURM says the job has ended.
    followed = _cli(["logs", job_id, "--follow", "--results-dir", str(results)], tmp_path, timeout=600)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip() == ""
    streamed = [line for line in followed.stdout.splitlines() if LOG_LINE.match(line)]
    for rank, node in enumerate(NODES):
        assert any(line.startswith(f"{node} r{rank} | rank {rank}/3 on {node}") for line in streamed), followed.stdout
    assert "node3 r2 | performance: 1.0123e+04 tokens/sec" in streamed


@pytest.fixture(scope="module")
def ballast_zoo(tmp_path_factory):
    """The sample models plus timeline_ballast: dummy_lastrank's script in a 500 MB image."""
    zoo = tmp_path_factory.mktemp("timeline") / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "docker" / "ballast.Dockerfile").write_text(BALLAST_DOCKERFILE)
    cards = json.loads((zoo / "models.json").read_text())
    lastrank = next(card for card in cards if card["name"] == "dummy_lastrank")
    ballast = dict(lastrank, name="timeline_ballast", dockerfile="docker/ballast", tags=["timeline_ballast"])
    (zoo / "models.json").write_text(json.dumps(cards + [ballast]))
    yield zoo / "models.json"


def _docker(node, *args):
    return subprocess.run(
        ["docker", "-H", node_docker_host(node), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_report_names_node3_the_load_straggler_when_only_node3_must_load_the_image(
    lab_cluster, pipeline_mode, tmp_path, ballast_zoo
):
    results = tmp_path / "results"
    model = ["--tags", "timeline_ballast", "--models-file", str(ballast_zoo)]
    # A first run leaves the image on every node (rank 0 builds and publishes it, the workers load it) ...
    first, _ = _submit(tmp_path, results, *model)
    manifest = json.loads((results / first / "attempt-0" / "build_manifest.json").read_text())
    (image,) = [entry["docker_image"] for entry in manifest["built_images"].values()]
    # ... then node3 alone loses it: the next run's node2 holds it, node3 loads 500 MB from the tar cache.
    removed = _docker("node3", "rmi", "-f", image)
    assert removed.returncode == 0, removed.stderr
    job_id, _ = _submit(tmp_path, results, *model)

    record = json.loads((results / "records" / f"{job_id}.json").read_text())
    load = next(entry for entry in record["stragglers"] if entry["step"] == "load")
    assert (load["node"], load["straggler"]) == ("node3", True), record["timeline"]
    assert set(record["barrier_wait"]) == set(NODES)

    report = _cli(["report", "--job", job_id, "--results-dir", str(results)], tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    assert re.search(r"^load: node3 took \d+\.\d s, \d+\.\dx the median of the others", report.stdout, re.M), (
        report.stdout
    )
    assert "; no straggler" not in next(line for line in report.stdout.splitlines() if line.startswith("load:"))
    assert re.search(r"^barrier wait: node1 \d+\.\d s, node2 \d+\.\d s, node3 \d+\.\d s$", report.stdout, re.M)
    # node1 and node2 waited at the barrier for node3's load.
    assert "barrier: node3 arrived last" in report.stdout
    # The table has a row per node.
    for node in NODES:
        assert re.search(rf"^{node}\s", report.stdout, re.M), report.stdout
