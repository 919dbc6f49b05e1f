"""A hung run's results dir as its nodes leave it, for the record's and the reports' tests.

The watchdog (module_utils/run/hang/watch.py) ended the run: rank 0's ABORT marker of kind hang, every node's
status.json (FAILURE, ``hang``, its stopped container's exit code 137), its run.log, and its stacks.json (the real
py-spy dumps of tests/fixtures/hang_stacks) with a stacks.txt beside it.
"""

import json
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, new_status

NODES = ("node1", "node2", "node3")
HANG_STACKS = Path(__file__).resolve().parents[2] / "fixtures" / "hang_stacks"
HUNG_NODE_REASON = "hang: no rank made progress for 5 s"


def _stacks_text(stacks: dict) -> str:
    """A plain stacks.txt for people: each process's command, then its threads' frames."""
    lines = []
    for process in stacks["processes"]:
        lines.append(f"process {process['pid']} (rank {process['rank']}): {process['command']}")
        for thread in process["threads"]:
            lines.append(f"  thread {thread['name']}")
            lines += [f"    {frame['function']} ({frame['file']}:{frame['line']})" for frame in thread["frames"]]
    return "\n".join(lines) + "\n"


def write_hung_job(results_dir: Path, job_id="42", stacks_case="allreduce", without_stacks=(), status_fields=None):
    """Lay out the hung run's attempt 0 under ``results_dir``; ``without_stacks``: nodes that wrote no stacks;
    ``status_fields``: {node: more status.json fields}. Returns the attempt dir."""
    attempt_dir = results_dir / job_id / "attempt-0"
    for rank, node in enumerate(NODES):
        node_dir = attempt_dir / "nodes" / node
        node_dir.mkdir(parents=True)
        fields = dict(status=FAILURE, hang=True, reason=HUNG_NODE_REASON, exit_code=137, started_at=1000.0)
        fields.update((status_fields or {}).get(node, {}))
        status = new_status(node, rank, len(NODES), job_id, "ddp_hang", **fields)
        (node_dir / "status.json").write_text(json.dumps(status))
        (node_dir / "run.log").write_text(f"rank {rank} joined\n")
        if node not in without_stacks:
            stacks = json.loads((HANG_STACKS / stacks_case / f"{node}.json").read_text())
            (node_dir / "stacks.json").write_text(json.dumps(stacks))
            (node_dir / "stacks.txt").write_text(_stacks_text(stacks))
    (attempt_dir / "ABORT").write_text(
        json.dumps({"rank": 0, "node": "node1", "reason": HUNG_NODE_REASON, "kind": "hang"})
    )
    return attempt_dir
