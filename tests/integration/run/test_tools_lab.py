"""MAD's tools on every node of a 3-node job: madengine's own test tools and our py-spy recorder.

The PyTorch sample (pyt_ddp_tiny: torchrun, DDP over gloo) with the context's tools test_tools_A, test_tools_B (from
madengine's own tools.json, unchanged: tests/fixtures/mad_tools, the job's tools_file) and pyspy_record. madengine's
order for A then B: pre_script B, pre_script A, cmd_B, cmd_A, the model, post_script A, post_script B.

One job, read by every test here. Push mode only: the tools are applied by the run module, which both modes run
alike on every node.
"""

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from slurm_multi.lab.pytorch import ensure_pytorch_base
from tests.support.lab.pipeline import run_pipeline

# mode_independent: one job, in push mode.
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

NODES = ("node1", "node2", "node3")
TOOLS_FILE = Path(__file__).resolve().parents[2] / "fixtures" / "mad_tools" / "scripts" / "common" / "tools.json"
TOOLS = [{"name": "test_tools_A"}, {"name": "test_tools_B"}, {"name": "pyspy_record"}]


@pytest.fixture(scope="module")
def tools_job(lab_cluster, tmp_path_factory):
    ensure_pytorch_base(NODES)  # only the model's thin layer then moves to the workers
    return run_pipeline(
        tmp_path_factory.mktemp("tools") / "results",
        mode="push",
        nodelist="node[1-3]",
        model_tags=["pyt_ddp_tiny"],
        additional_context={"tools": TOOLS},
        tools_file=str(TOOLS_FILE),
    )


def _node_dir(job, node) -> Path:
    return job.attempt_dir / "nodes" / node


def test_the_job_with_the_tools_succeeds(tools_job):
    assert tools_job.rc == 0 and tools_job.record["status"] == "SUCCESS", tools_job.output[-3000:]


@pytest.mark.parametrize("rank, node", list(enumerate(NODES)))
def test_each_nodes_log_shows_the_scripts_and_the_wrapped_command_in_madengines_order(tools_job, rank, node):
    lines = (_node_dir(tools_job, node) / "run.log").read_text().splitlines()
    expected = [
        "pre_script B",
        "pre_script A",
        "cmd_B",
        "cmd_A",
        f"rank {rank}/3 joined",
        "post_script A",
        "post_script B",
    ]
    found = [next((at for at, line in enumerate(lines) if line.startswith(text)), None) for text in expected]
    assert None not in found and found == sorted(found), "\n".join(lines[-60:])


@pytest.mark.parametrize("rank, node", list(enumerate(NODES)))
def test_every_rank_has_its_flame_graph_of_its_training_script(tools_job, rank, node):
    graph = _node_dir(tools_job, node) / "tools" / f"pyspy-rank{rank}.svg"
    assert ElementTree.parse(graph).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert "train_ddp.py" in graph.read_text()


def test_every_nodes_status_lists_the_tools_applied_and_their_outputs(tools_job):
    for rank, node in enumerate(NODES):
        status = tools_job.status(node)
        assert status["tools"] == [tool["name"] for tool in TOOLS], status
        assert status["tool_outputs"] == [f"tools/pyspy-rank{rank}.svg"], status
