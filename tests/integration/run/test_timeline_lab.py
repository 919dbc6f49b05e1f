"""Issue 19 on the lab: `submit --wait --follow` streams every rank's log lines while the job runs and `logs JOB`
shows the same lines afterwards (both modes: pull mode's lines come through each node's own step), and a node made
to load a large image alone is named the straggler of the load step by `report --job` (push mode)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.submit.test_submit_lab import _cli, _cli_env, _job_output
from tests.support.lab.lab_nodes import node_docker_host
from tests.support.lab.per_mode_jobs import once_per_mode

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[3]
NODES = ("node1", "node2", "node3")
LOG_LINE = re.compile(r"^(node\d+) r(\d+) \| (.*)$")

# 1 GB of random bytes (no compression helps): a node that must `docker load` it takes seconds, a node that holds
# the image takes a fraction of one. 250 MB loaded in 0.65 s on a fast machine, under the straggler rule's 1 s floor
# (module_utils/results/timeline.py), and the test failed there in both modes.
BALLAST_DOCKERFILE = """# CONTEXT {'guest_os': 'UBUNTU'}
# A large image for the load-straggler lab test (tests/integration/run/test_timeline_lab.py).
ARG BASE_DOCKER=slurm-multi-lab/busybox:latest
FROM $BASE_DOCKER
RUN dd if=/dev/urandom of=/ballast bs=1M count=1024
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


@pytest.fixture(scope="module")
def followed_job(lab_cluster, tmp_path_factory):
    """mode -> (job ID, results dir, submit's stdout, the output of `logs JOB --follow`, squeue's word on the job when
    that ended, a dir for the CLI): one job per mode, run by `submit --wait --follow`. `logs JOB --follow` starts
    beside it the moment submit names the job, before any node has written a line (the job is pending or
    preparing), and must end by itself once SLURM says the job has ended."""

    def run(mode):
        tmp_path = tmp_path_factory.mktemp(f"timeline-follow-{mode}")
        results = tmp_path / "results"
        env = _cli_env(tmp_path)
        cli = [sys.executable, "-m", "slurm_multi.cli"]
        submit_args = ["submit", "-N", "3", "--nodelist", "node[1-3]", "--no-exclusive", "--results-dir"]
        submit_args += [str(results), "--wait", "--tags", "dummy_lastrank", "--follow"]
        with subprocess.Popen(cli + submit_args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True) as submit:
            lines = []
            for line in submit.stdout:
                lines.append(line)
                if "Submitted job " in line:
                    break
            job_id = "".join(lines).split("Submitted job ")[1].split()[0]
            follow = subprocess.run(
                cli + ["logs", job_id, "--follow", "--results-dir", str(results)],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip()
            lines.extend(submit.stdout)
            assert submit.wait(timeout=600) == 0, "".join(lines)[-4000:]
        assert follow.returncode == 0, follow.stdout + follow.stderr
        return job_id, results, "".join(lines), follow.stdout, queued, tmp_path

    return once_per_mode(run, output=lambda made: _job_output(made[5], made[0]))


def test_submit_follow_streams_every_rank_while_the_job_runs_and_logs_shows_the_same(followed_job, pipeline_mode):
    job_id, results, out, _, _, tmp_path = followed_job(pipeline_mode)
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


def test_logs_follow_started_with_the_job_streams_every_rank_and_ends_with_it(followed_job, pipeline_mode):
    _, _, _, followed, queued, _ = followed_job(pipeline_mode)
    assert queued == "", f"logs --follow ended while SLURM still had the job: {queued}"
    streamed = [line for line in followed.splitlines() if LOG_LINE.match(line)]
    for rank, node in enumerate(NODES):
        assert any(line.startswith(f"{node} r{rank} | rank {rank}/3 on {node}") for line in streamed), followed
    assert "node3 r2 | performance: 1.0123e+04 tokens/sec" in streamed


@pytest.fixture(scope="module")
def ballast_zoo(tmp_path_factory):
    """The sample models plus timeline_ballast: dummy_lastrank's script in a 1 GB image."""
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


@pytest.fixture(scope="module")
def ballast_everywhere(lab_cluster, tmp_path_factory, ballast_zoo):
    """The ballast image's name, once a first run (it only sets the stage) left it on every node:
    rank 0 built and published it, the workers loaded it."""
    tmp_path = tmp_path_factory.mktemp("timeline-ballast")
    results = tmp_path / "results"
    first, _ = _submit(tmp_path, results, "--tags", "timeline_ballast", "--models-file", str(ballast_zoo))
    manifest = json.loads((results / first / "attempt-0" / "build_manifest.json").read_text())
    (image,) = [entry["docker_image"] for entry in manifest["built_images"].values()]
    return image


# Push mode only (the default): the timeline is read from each node's steps, which the same modules record in both
# modes (the handoff's load, the run module's barrier); test_real_workloads_lab reads a pull run's load steps.
@pytest.mark.mode_independent
def test_report_names_node3_the_load_straggler_when_only_node3_must_load_the_image(
    tmp_path, ballast_zoo, ballast_everywhere
):
    results = tmp_path / "results"
    model = ["--tags", "timeline_ballast", "--models-file", str(ballast_zoo)]
    image = ballast_everywhere
    # node3 alone loses the image every node holds: this run's node2 holds it, node3 loads 1 GB from the tar cache.
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
