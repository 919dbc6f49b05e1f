"""benchmarks/scale_bench.py still runs the real run_multi.yml in check mode, in both modes, without a failing task.

The bench is the issue 16 scale simulation: if a role's task stops working in check mode (a module writing, the
docker stub refused, a variable check mode does not set), the simulated runs fail and its figures mean nothing. Two
simulated nodes keep this quick; the figures' values are not checked (benchmarks/README.md holds them), their shape is.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/sys/fs/cgroup/cpuacct/cpuacct.usage").exists(),
    reason="scale_bench accounts CPU with cgroups: root and cgroup v1 cpuacct",
)


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "figures.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_bench", "--nodes", "2", "--pull-nodes", "2"]
        + ["--json", str(out), "--timeout", "300"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return json.loads(out.read_text()), completed.stdout


def test_push_mode_runs_every_task_on_both_nodes_without_a_failure(figures):
    (run,) = figures[0]["push"]["2"]
    assert run["rc"] == 0 and run["failed"] == 0
    names = [task["name"] for task in run["tasks"]]
    assert not any("Record why this node stopped" in name for name in names), names
    by_name = {task["name"]: task for task in run["tasks"]}
    assert by_name["running : Run the model on every node at once"]["hosts"] == 2
    assert by_name["build : Hand rank 0's image to every node through the shared tar cache"]["hosts"] == 2
    assert run["controller_cpu"] > 0 and run["module_cpu"] > 0 and run["peak_rss_mb"] > 0


def test_pull_mode_runs_rank_0_and_a_worker_each_against_itself(figures):
    pull = figures[0]["pull"]
    assert sorted(run["rank"] for run in pull) == [0, 1]
    for run in pull:
        assert run["rc"] == 0 and run["failed"] == 0, run
        names = [task["name"] for task in run["tasks"]]
        assert "running : Run the model on every node at once" in names
        assert all(task["hosts"] <= 1 for task in run["tasks"])
    (collect,) = figures[0]["collect"]
    assert collect["rc"] == 0 and collect["failed"] == 0


def test_the_tables_print_from_the_saved_figures(figures, tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(figures[0]))
    printed = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_bench", "--print", str(saved)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == figures[1][figures[1].index("\nPush mode") :].split("\nkept ")[0]


def test_the_inventory_probe_parses_the_real_plugin_and_the_group_variable_variant():
    printed = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_bench", "--inventory", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = re.findall(r"N=\s*4 (slurm_allocation plugin|allocation_nodes on `all`)\s+([\d.]+) s\s+(\d+) MB", printed)
    assert [label for label, _, _ in lines] == ["slurm_allocation plugin", "allocation_nodes on `all`"], printed
    assert all(float(seconds) >= 0 and int(megabytes) > 0 for _, seconds, megabytes in lines), printed
