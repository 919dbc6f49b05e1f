"""Rank 0's image announcement (pull mode): written whole, waited for, given up at the ABORT marker, checked."""

import json
import threading
import time

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import (
    AnnouncementError,
    announcement_path,
    wait_for_announcement,
    write_announcement,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import write_abort_marker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import Heartbeat

IMAGE_ID = "sha256:" + "ab" * 32


def test_a_worker_gets_what_rank_0_announces_while_it_waits(tmp_path):
    threading.Timer(0.3, write_announcement, (str(tmp_path), "ci-dummy_dummy", IMAGE_ID)).start()
    announcement = wait_for_announcement(str(tmp_path), timeout=10, poll=0.05)
    assert (announcement["reference"], announcement["image_id"]) == ("ci-dummy_dummy", IMAGE_ID)
    assert announcement["waited_seconds"] >= 0.2


def test_the_abort_marker_ends_the_wait_at_once_naming_the_node_that_failed(tmp_path):
    threading.Timer(0.2, write_abort_marker, (str(tmp_path), 0, "node1", "the build failed")).start()
    started = time.monotonic()
    with pytest.raises(AnnouncementError, match=r"rank 0 \(node1\) failed: the build failed"):
        wait_for_announcement(str(tmp_path), timeout=30, poll=0.05)
    assert time.monotonic() - started < 5


def test_a_worker_stopped_by_rank_0s_marker_says_so_and_is_no_root_cause(tmp_path):
    # Pull mode: a worker still waiting for rank 0's image when rank 0 fails must name rank 0 as the one that gave
    # the run up (the record blamed it as a root cause too, seen in test_barrier_ports[pull]).
    import sys

    from plugins.filter.job_layout import stage_failure_status
    from tests.support.ansible import run_ansible

    write_abort_marker(str(tmp_path), 0, "node1", "every barrier port candidate is in use")
    args = f"job_dir={tmp_path} state=received timeout=5"
    argv = ["ansible", "localhost", "-c", "local", "-m", "image_announcement", "-a", args]
    result = run_ansible([*argv, "-e", f"ansible_python_interpreter={sys.executable}"])
    assert result.returncode != 0 and "aborted_by_rank: 0" in result.stdout, result.stdout
    failed = {"msg": "the run was given up while this node waited for rank 0's image", "aborted_by_rank": 0}
    status = stage_failure_status("node3", 2, 3, "4242", stage="build", failed_result=failed)
    assert status["aborted_by_rank"] == 0


def test_a_timeout_names_the_file_and_what_to_check(tmp_path):
    with pytest.raises(AnnouncementError, match="announced no image in .*image.json within 0.2 s: check rank 0"):
        wait_for_announcement(str(tmp_path), timeout=0.2, poll=0.05)


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "cannot be read"),
        ("[]", "not a JSON object"),
        (json.dumps({"reference": "x", "image_id": "sha256:short"}), "is not an image ID"),
        (json.dumps({"reference": "has space", "image_id": IMAGE_ID}), "is not an image reference"),
    ],
)
def test_a_malformed_announcement_is_an_error_not_an_image(tmp_path, content, message):
    with open(announcement_path(str(tmp_path)), "w") as handle:
        handle.write(content)
    with pytest.raises(AnnouncementError, match=message):
        wait_for_announcement(str(tmp_path), timeout=1, poll=0.05)


def test_rank_0_refuses_to_announce_something_that_is_not_an_image_id(tmp_path):
    with pytest.raises(AnnouncementError, match="is not an image ID"):
        write_announcement(str(tmp_path), "ci-dummy_dummy", "ci-dummy_dummy")
    assert not (tmp_path / "image.json").exists()


def _beat(path, beats, every=0.1):
    for count in range(beats):
        path.write_text(str(count))
        time.sleep(every)


def test_a_worker_waits_while_rank_0s_heartbeat_goes_on_and_takes_the_announcement(tmp_path):
    beat = tmp_path / "playbook.alive"
    beating = threading.Thread(target=_beat, args=(beat, 15))
    beating.start()
    threading.Timer(1.2, write_announcement, (str(tmp_path), "ci-dummy_dummy", IMAGE_ID)).start()
    heartbeat = Heartbeat(str(beat), stale_after=0.5)
    announcement = wait_for_announcement(str(tmp_path), poll=0.05, rank0_heartbeat=heartbeat, rank0="rank 0 (node1)")
    beating.join()
    assert announcement["image_id"] == IMAGE_ID and announcement["waited_seconds"] >= 1.0  # > stale_after: alive


def test_a_heartbeat_that_stands_still_ends_the_wait_naming_rank_0(tmp_path):
    beat = tmp_path / "playbook.alive"
    _beat(beat, 3)  # then rank 0's playbook dies: no ABORT marker, no announcement
    started = time.monotonic()
    with pytest.raises(AnnouncementError, match=r"rank 0 \(node1\)'s playbook stopped its heartbeat .* it died"):
        wait_for_announcement(
            str(tmp_path), poll=0.05, rank0_heartbeat=Heartbeat(str(beat), 0.5), rank0="rank 0 (node1)"
        )
    assert time.monotonic() - started < 2


def test_a_heartbeat_that_never_appears_ends_the_wait_too(tmp_path):
    with pytest.raises(AnnouncementError, match=r"never wrote its heartbeat"):
        wait_for_announcement(str(tmp_path), poll=0.05, rank0_heartbeat=Heartbeat(str(tmp_path / "none"), 0.3))
