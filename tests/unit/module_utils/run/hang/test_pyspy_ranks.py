"""pyspy_record's recorder: which of a container's processes are ranks, and a real `py-spy record` of one.

tests/fixtures/process_tables/torchrun-two-workers-with-forks.json is module_utils/run/pyspy_ranks.process_table() as
taken inside a lab container (slurm-multi-lab/pytorch:2.13.0, RANK=1 and NODE_RANK=1 in its environment, as the
torchrun launcher gives node 1): a stand-in watcher (pid 7) running `torchrun --standalone --nproc_per_node=2` whose
workers each forked a data loader, and a Python process outside the watcher's tree (pid 9).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.pyspy_ranks import (
    Process,
    is_launcher,
    main,
    process_table,
    rank_processes,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import find_pyspy

TABLE = Path(__file__).resolve().parents[4] / "fixtures" / "process_tables" / "torchrun-two-workers-with-forks.json"


def _recorded_table():
    recorded = json.loads(TABLE.read_text())
    return {entry["pid"]: Process(**entry) for entry in recorded["processes"]}, recorded["watcher"]


def test_the_ranks_are_torchruns_workers_by_their_rank_not_the_launcher_nor_their_forked_loaders():
    # The launcher's RANK is the node's (1), as the second worker's: only the process tree tells them apart.
    assert rank_processes(*_recorded_table()) == {14: "0", 15: "1"}


def test_a_model_without_a_launcher_is_one_rank_named_by_the_nodes_rank():
    processes = {
        7: Process(7, 1, "/usr/bin/python3.11", ["python3", "-c", "watcher"], "2"),
        8: Process(8, 7, "/usr/bin/bash", ["bash", "run.sh"], "2"),
        9: Process(9, 8, "/usr/bin/python3.11", ["python3", "train.py"], "2"),
        10: Process(10, 9, "/usr/bin/python3.11", ["python3", "train.py"], "2"),
    }
    assert rank_processes(processes, 7) == {9: "2"}


@pytest.mark.parametrize(
    "argv, launcher",
    [
        (["/usr/bin/python3", "/usr/local/bin/torchrun", "--nnodes=3", "train.py"], True),
        (["python3", "-u", "-m", "torch.distributed.run", "train.py"], True),
        (["python", "-mtorch.distributed.launch", "train.py"], True),
        (["python3", "-X", "faulthandler", "/opt/bin/deepspeed", "train.py"], True),
        (["python3", "train.py", "--deepspeed", "ds.json"], False),
        (["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"], False),
        (["python3", "-m", "vllm.entrypoints.api_server"], False),
    ],
)
def test_a_launcher_is_known_by_its_script_or_module_whatever_its_options(argv, launcher):
    assert is_launcher(argv) is launcher


def test_the_process_table_reads_this_process_from_proc():
    me = process_table()[os.getpid()]
    assert (me.ppid, me.exe) == (os.getppid(), os.path.realpath(sys.executable))


def test_a_rank_recorded_for_real_gets_its_flame_graph_and_the_commands_exit_code_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_MULTI_TOOLS_DIR", str(tmp_path))
    monkeypatch.setenv("PYSPY_RECORD_OPTIONS", "--idle")
    rank = "import time, sys\ndef load_batch():\n    time.sleep(2.5)\nload_batch()\nsys.exit(3)\n"
    (tmp_path / "train.py").write_text(rank)
    command = ["/bin/sh", "-c", f"RANK=5 exec {sys.executable} {tmp_path / 'train.py'}"]
    assert main(command, pyspy=find_pyspy()) == 3
    graph = (tmp_path / "pyspy-rank5.svg").read_text()
    assert graph.startswith("<?xml") and "<svg" in graph and "load_batch" in graph
