"""`submit --preflight` on the lab: the candidate nodes are checked with one srun before submitting, a node whose
Docker daemon is down is left out (named, with why), and the job runs on healthy nodes; too few healthy nodes is
a clear error and nothing is submitted.

node3's dockerd is stopped for the whole test and restarted in a finally (lab_daemon_stopped). With 4 lab nodes
up the job asks for 3 (it runs on node1,2,4); with 3, for 2.
"""

import json
import time

import pytest

from slurm_multi.submission import sbatch
from tests.faults import lab_daemon_stopped
from tests.integration.submit.test_submit_lab import _cli

pytestmark = [pytest.mark.lab, pytest.mark.fault]


def test_preflight_leaves_out_a_node_whose_docker_is_down_and_the_job_succeeds(lab_cluster, tmp_path):
    results = tmp_path / "results"
    usable = sbatch.usable_nodes()
    nodes = 3 if len(usable) >= 4 else 2
    common = ["submit", "--no-exclusive", "--preflight", "--results-dir", str(results), "--tags", "dummy"]
    with lab_daemon_stopped("node3", "dockerd"):
        # Every usable node asked for: one is unhealthy, so too few remain; nothing is submitted.
        refused = _cli([*common, "-N", str(len(usable))], tmp_path)
        started = time.monotonic()
        run = _cli([*common, "-N", str(nodes), "--wait"], tmp_path, timeout=600)
        seconds = time.monotonic() - started
    refusal = refused.stdout + refused.stderr
    assert refused.returncode == 2, refusal[-3000:]
    assert f"only {len(usable) - 1} of the {len(usable)} candidate nodes are healthy" in refusal, refusal[-3000:]
    assert "node3: docker: Docker daemon not answering" in refusal and "Nothing was submitted" in refusal
    assert "Submitted job" not in refusal

    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "preflight: leaving out node3: docker: Docker daemon not answering on node3" in output, output[-3000:]
    (job_id,) = [path.stem for path in (results / "records").glob("*.json")]  # the refusal left no job
    record = json.loads((results / "records" / f"{job_id}.json").read_text())
    assert record["status"] == "SUCCESS", record["reason"]
    assert "node3" not in record["nodes"] and len(record["nodes"]) == nodes
    selection = record["node_selection"]
    assert selection["left_out"] == ["node3"] and selection["chosen"] == record["nodes"]
    assert "Docker daemon not answering" in selection["checked"]["node3"][0]["problem"]
    assert all(selection["checked"][node] == [] for node in record["nodes"])
    assert "left by the preflight" not in output and "left out by the preflight: node3: Docker daemon" in output
    assert seconds < 400, seconds
    # The nonce files written for the check are gone from the results dir.
    assert not list(results.glob(".preflight-select-*"))
