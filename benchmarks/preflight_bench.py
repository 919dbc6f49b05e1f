"""What the preflight stage adds to a job: a 3-node `dummy` run on the lab with and without it, side by side.

Run on the lab cluster (`slurm-multi lab up`):

    python -m benchmarks.preflight_bench [--repeat 3] [--modes push,pull]

Each repeat runs the real pipeline (tests/support/lab/pipeline.run_pipeline: salloc on node[1-3], push mode's
ansible-playbook or pull mode's real sbatch script) twice, taking turns: with the default `preflight_checks` and
with `preflight_checks: []` (the stage skipped: no nonce, no module call). Reported per mode: each variant's
median wall time (salloc to the record), their difference, and the preflight step's own time on the nodes (the
record's timeline: the module's start to end, the slowest node), and the stage's time in Ansible (the
task_profile callback: from the first preflight task to the first preparation task, per-task overhead included;
with the stage off, its one remaining controller-side set_fact). The lab machine is shared and noisy: the wall
times swing by tens of seconds between runs, the stage's time does not: it is the figure to judge.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.e2e_bench import profiled_env
from tests.support.ansible import ROOT, ansible_env
from tests.support.lab.pipeline import MODE_ENV, run_pipeline

NODELIST = "node[1-3]"
CHECKS_OFF = []


def preflight_span(profile: Path):
    """Seconds each ansible-playbook spent from its first preflight task to its first preparation task (the stage's
    whole cost, Ansible's per-task overhead included), the slowest playbook's (pull mode runs one per node)."""
    starts = {}
    for line in profile.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") != "task":
            continue
        per_pid = starts.setdefault(event["pid"], {})
        per_pid.setdefault(event.get("role"), event["t"])
    spans = [p["preparation"] - p["preflight"] for p in starts.values() if "preflight" in p and "preparation" in p]
    return max(spans) if spans else None


def one_run(work: Path, label: str, checks) -> dict:
    """One pipeline run; its wall time and the slowest node's preflight step (None when the stage was off)."""
    results_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work)) / "results"
    extra = {} if checks is None else {"preflight_checks": checks}
    profile = results_dir.parent / "task_profile.jsonl"
    env = ansible_env(**profiled_env(ROOT, profile, base={}))
    started = time.monotonic()
    run = run_pipeline(results_dir, nodelist=NODELIST, env=env, model_tags=["dummy"], **extra)
    wall = time.monotonic() - started
    records = list((results_dir / "records").glob("*/attempt-0.json"))
    if run.rc != 0 or not records:
        raise SystemExit(f"{label}: the run failed (rc {run.rc}):\n{run.output[-3000:]}")
    record = json.loads(records[0].read_text())
    steps = [node.get("preflight") for node in record["timeline"].values() if (node or {}).get("preflight")]
    step = max((s["end"] - s["start"] for s in steps), default=None)
    return {"wall": wall, "step": step, "stage": preflight_span(profile)}


def bench(mode: str, repeat: int, work: Path) -> dict:
    os.environ[MODE_ENV] = mode
    samples = {"with": [], "without": []}
    for index in range(repeat):
        # Taking turns, the order swapped each repeat: a slow minute of the shared machine hits both.
        order = [("with", None), ("without", CHECKS_OFF)]
        for label, checks in order if index % 2 == 0 else order[::-1]:
            result = one_run(work, f"{mode}-{label}", checks)
            samples[label].append(result)
            step = f", preflight step {result['step']:.2f} s" if result["step"] is not None else ""
            print(
                f"{mode} {label:7} preflight: {result['wall']:.1f} s, stage {result['stage']:.2f} s{step}", flush=True
            )
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default="push,pull")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="preflight-bench-") as scratch:
        for mode in args.modes.split(","):
            samples = bench(mode, args.repeat, Path(scratch))
            with_wall = statistics.median(s["wall"] for s in samples["with"])
            without_wall = statistics.median(s["wall"] for s in samples["without"])
            steps = [s["step"] for s in samples["with"] if s["step"] is not None]
            stage_with = statistics.median(s["stage"] for s in samples["with"])
            stage_without = statistics.median(s["stage"] for s in samples["without"])
            print(
                f"{mode}: median {with_wall:.1f} s with preflight, {without_wall:.1f} s without "
                f"({with_wall - without_wall:+.1f} s); the stage in Ansible {stage_with:.2f} s with, "
                f"{stage_without:.2f} s without ({stage_with - stage_without:+.2f} s); the module on the nodes "
                f"{statistics.median(steps):.2f} s (max {max(steps):.2f} s); {args.repeat} run(s) each",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
