"""Pull mode: rank 0's ansible-playbook dies mid-build, and the workers waiting for its image stop within a minute,
naming rank 0, instead of waiting until the job's time limit.

Only the playbook process is killed (SIGKILL, as the OOM killer would): its build module and `docker build` live on,
as they would on a real node, so only the playbook's heartbeat (roles/preparation) can tell the workers.
"""

import json
import os
import re
import shutil
import signal
import threading
import time
import uuid

import pytest

from tests.support.ansible import ROOT
from tests.support.lab.pipeline import run_pipeline

pytestmark = [pytest.mark.lab, pytest.mark.fault, pytest.mark.mode_independent]

# Shorter than the default 30 s, so the test waits less; the reason's figure shows the setting reached the wait.
HEARTBEAT_STALE = 10
# Long enough to be killed in, short enough that the orphaned build ends soon after the test.
SLOW_BUILD = """# CONTEXT {'guest_os': 'UBUNTU'}
FROM slurm-multi-lab/busybox:latest
RUN echo NONCE && sleep 40
"""


def _zoo(base):
    zoo = base / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    (zoo / "docker" / "slow_build.Dockerfile").write_text(SLOW_BUILD.replace("NONCE", uuid.uuid4().hex))
    cards = json.loads((zoo / "models.json").read_text())
    slow = dict(cards[0], name="slow_build", dockerfile="docker/slow_build", tags=["slow_build"])
    (zoo / "models.json").write_text(json.dumps(cards + [slow]))
    return zoo


@pytest.fixture(scope="module")
def rank0_killed_mid_build(lab_cluster, tmp_path_factory):
    """(the run, seconds from the kill to the run's end, the command line of the process killed)."""
    base = tmp_path_factory.mktemp("rank0-playbook-death")
    results = base / "results"
    ran = {}
    job = threading.Thread(
        target=lambda: ran.update(
            run=run_pipeline(
                results,
                mode="pull",
                nodelist="node[1-3]",
                models_file=str(_zoo(base) / "models.json"),
                model_tags=["slow_build"],
                heartbeat_stale=HEARTBEAT_STALE,
            )
        )
    )
    job.start()
    deadline = time.monotonic() + 300
    while True:
        beats = list(results.glob("*/attempt-0/nodes/node1/playbook.alive"))
        build_logs = list(results.glob("*/attempt-0/slow_build_*.build.live.log"))
        if beats and build_logs and "sleep 40" in build_logs[0].read_text():
            break
        assert job.is_alive() and time.monotonic() < deadline, "rank 0 never started its build"
        time.sleep(0.5)
    pid = int(beats[0].read_text().split()[0])
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        killed_command = handle.read().replace(b"\0", b" ").decode()
    os.kill(pid, signal.SIGKILL)  # rank 0's ansible-playbook, of this test's own job
    killed = time.monotonic()
    job.join(300)
    return ran["run"], time.monotonic() - killed, killed_command


def test_the_workers_stop_within_a_minute_of_rank0s_playbook_dying_naming_rank0(rank0_killed_mid_build):
    run, seconds, _ = rank0_killed_mid_build
    assert run.rc != 0
    assert seconds < 60, seconds
    for node in ("node2", "node3"):
        reason = run.status(node)["reason"]
        assert "rank 0 (node1)'s playbook stopped its heartbeat" in reason and "it died" in reason, reason
    assert "rank 0 (node1)'s playbook stopped its heartbeat" in run.record["reason"]
    stood_still = int(re.search(r"stopped its heartbeat \S+ (\d+) s ago", run.record["reason"]).group(1))
    assert HEARTBEAT_STALE <= stood_still < 25, run.record["reason"]  # heartbeat_stale, not the default 30


def test_the_heartbeat_names_rank0s_playbook_process_itself(rank0_killed_mid_build):
    run, _, killed_command = rank0_killed_mid_build
    # The pipeline's ansible-playbook: slurm-multi-playbook (slurm_multi/speedup/playbook.py).
    assert "slurm-multi-playbook" in killed_command and "run_multi.yml" in killed_command, killed_command
    assert "--limit node1" in killed_command and run.record["status"] == "FAILURE"
