"""A node's watch on rank 0 (pull mode: its playbook's heartbeat; push mode: its module's), and the beat rank 0's
modules keep in push mode: real files, real threads, short stale times."""

import os
import threading
import time

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import (
    MODULE_HEARTBEAT_FILE,
    Rank0Watch,
    beating,
    node_liveness,
)


@pytest.fixture
def rank0_dir(tmp_path):
    path = tmp_path / "nodes" / "gpu01"
    path.mkdir(parents=True)
    return path


def keep_beating(path, stop, every=0.1):
    while not stop.wait(every):
        path.write_text(f"4242 {time.time()}\n")


def watch_until(watch, seconds):
    """What `watch.lost()` said first within `seconds`, or None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lost = watch.lost()
        if lost:
            return lost
        time.sleep(0.05)
    return None


def test_a_worker_finds_rank0_lost_once_its_playbook_heartbeat_stood_still(tmp_path, rank0_dir):
    (rank0_dir / "playbook.alive").write_text("4242 1733150000.5\n")
    lost = watch_until(Rank0Watch(str(tmp_path), "gpu01", rank=1, stale_after=0.5), 5)
    assert lost.startswith(f"rank 0 (gpu01)'s playbook stopped its heartbeat {rank0_dir / 'playbook.alive'}"), lost
    assert lost.endswith(": rank 0 is lost (killed, or its node died)")


def test_a_quiet_rank0_whose_heartbeat_goes_on_is_never_lost(tmp_path, rank0_dir):
    stop = threading.Event()
    beater = threading.Thread(target=keep_beating, args=(rank0_dir / "playbook.alive", stop))
    beater.start()
    try:
        assert watch_until(Rank0Watch(str(tmp_path), "gpu01", rank=1, stale_after=0.5), 2.5) is None
    finally:
        stop.set()
        beater.join()


def test_rank0_that_wrote_its_status_ended_its_run_and_is_not_lost(tmp_path, rank0_dir):
    (rank0_dir / "playbook.alive").write_text("4242 1733150000.5\n")
    (rank0_dir / "status.json").write_text("{}")
    assert watch_until(Rank0Watch(str(tmp_path), "gpu01", rank=1, stale_after=0.3), 1.5) is None


def test_a_rank0_that_never_beat_is_lost_too_naming_its_module_in_push_mode(tmp_path, rank0_dir):
    lost = watch_until(Rank0Watch(str(tmp_path), "gpu01", rank=2, heartbeat="module", stale_after=0.3), 3)
    assert lost.startswith(f"rank 0 (gpu01)'s module never wrote its heartbeat {rank0_dir / MODULE_HEARTBEAT_FILE}")


def test_rank0_watching_its_own_playbook_names_itself(tmp_path, rank0_dir):
    (rank0_dir / "playbook.alive").write_text("4242 1733150000.5\n")
    lost = watch_until(Rank0Watch(str(tmp_path), "gpu01", rank=0, stale_after=0.3), 3)
    assert lost.startswith("rank 0 (gpu01)'s own playbook stopped its heartbeat"), lost


def test_each_node_gets_its_part_by_mode_and_rank(tmp_path):
    nodes = ["gpu01", "gpu02"]
    pull_rank0, pull_worker = (node_liveness(str(tmp_path), nodes, rank, "playbook", 30) for rank in (0, 1))
    assert pull_rank0.watch and pull_rank0.beat is None and pull_worker.watch and pull_worker.beat is None
    push_rank0, push_worker = (node_liveness(str(tmp_path), nodes, rank, "module", 30) for rank in (0, 1))
    assert push_rank0.watch is None and push_rank0.beat == str(tmp_path / "nodes" / "gpu01" / MODULE_HEARTBEAT_FILE)
    assert push_worker.watch and push_worker.beat is None
    for off in (node_liveness(str(tmp_path), nodes, 1, "playbook", 0), node_liveness(None, nodes, 1, "module", 30)):
        assert off.watch is None and off.beat is None
    assert node_liveness(str(tmp_path), ["gpu01"], 0, "module", 30).beat is None  # one node: no one to tell
    with pytest.raises(ValueError, match="heartbeat must be one of playbook, module, got 'ssh'"):
        node_liveness(str(tmp_path), nodes, 1, "ssh", 30)


def test_the_beat_changes_while_the_block_runs_and_stands_still_after(rank0_dir):
    path = rank0_dir / MODULE_HEARTBEAT_FILE
    with beating(str(path), interval=0.1):
        first = path.read_text()  # written before the block starts
        assert first.split()[0] == str(os.getpid())
        time.sleep(0.35)
        assert path.read_text() != first
    last = path.read_text()
    time.sleep(0.3)
    assert path.read_text() == last


def test_a_beat_that_cannot_be_written_fails_the_caller_before_its_block(tmp_path):
    ran = []
    with pytest.raises(FileNotFoundError):
        with beating(str(tmp_path / "no-such-dir" / MODULE_HEARTBEAT_FILE)):
            ran.append(True)
    assert not ran
