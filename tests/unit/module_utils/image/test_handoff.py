"""Rank 0's image handed to every node in one task (module_utils/image/handoff.py): rank 0 publishes and announces,
each worker waits for the announcement and loads what it names; the announcement and the ABORT marker are real
files, the cache a stand-in whose own behaviour tests/unit/module_utils/image/cache/test_image_cache.py covers
against real daemons."""

import threading
import time

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image import handoff
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import (
    AnnouncementError,
    read_announcement,
    write_announcement,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheResult
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import (
    read_abort_marker,
    write_abort_marker,
)

IMAGE = "ci-dummy:latest"
RANK0_ID = "sha256:" + "a" * 64


class StandInCache:
    """What handoff asks of the cache: a publish (not taught: the lesson comes after the announcement) and a load."""

    def __init__(self, publish_error=None, held=False):
        self.publish_error = publish_error
        self.held = held
        self.calls = []

    def publish(self, image, teach=True):
        self.calls.append(("publish", image, teach))
        if self.publish_error:
            raise self.publish_error
        if self.held:
            return CacheResult("already-present", False, RANK0_ID, started=time.monotonic())
        saved = CacheResult("saved", True, RANK0_ID, started=time.monotonic())
        saved.teachable = True  # a whole save (publish_image's own flag)
        return saved

    def load(self, image_id, image=None, marker_wait=0, rebuild=None):
        self.calls.append(("load", image_id, image))
        return CacheResult("loaded", True, image_id, started=time.monotonic())


@pytest.fixture(autouse=True)
def stand_in_cache_calls(monkeypatch):
    """handoff's publish and load go to the stand-in cache passed in, whose calls the tests read."""
    monkeypatch.setattr(handoff, "publish_image", lambda cache, image, teach=True: cache.publish(image, teach=teach))
    monkeypatch.setattr(
        handoff,
        "load_image",
        lambda cache, image_id, image=None, marker_wait=0, rebuild=None: cache.load(
            image_id, image, marker_wait, rebuild
        ),
    )


@pytest.fixture
def rank0(tmp_path):
    (tmp_path / "nodes" / "node1").mkdir(parents=True)  # rank 0's node dir, made by its preparation stage
    return handoff.Rank0(str(tmp_path), "node1", heartbeat="module", heartbeat_stale=5)


def test_rank_0_announces_the_id_it_published_then_teaches_its_daemon(rank0, monkeypatch):
    lessons = []
    monkeypatch.setattr(handoff, "teach_daemon", lambda cache, image: lessons.append(image) or {"taught": True})
    cache = StandInCache()
    outcome, announced = handoff.publish_and_announce(cache, IMAGE, rank0)
    assert read_announcement(rank0.attempt_dir) == {"reference": IMAGE, "image_id": RANK0_ID}
    assert cache.calls == [("publish", IMAGE, False)] and lessons == [IMAGE]
    assert outcome.as_dict()["taught"] is True and announced <= time.time()


def test_a_lesson_that_fails_leaves_the_publish_announced_and_says_why(rank0, monkeypatch):
    def failing_lesson(cache, image):
        raise OSError("the push target could not start")

    monkeypatch.setattr(handoff, "teach_daemon", failing_lesson)
    outcome, _ = handoff.publish_and_announce(StandInCache(), IMAGE, rank0)
    assert read_announcement(rank0.attempt_dir)["image_id"] == RANK0_ID
    assert "the push target could not start" in outcome.as_dict()["not_taught"]


def test_an_image_the_cache_held_already_teaches_nothing(rank0, monkeypatch):
    # Every warm job: asking the daemon would cost rank 0 a push while the workers wait for the task to end.
    monkeypatch.setattr(handoff, "teach_daemon", lambda cache, image: pytest.fail("taught"))
    outcome, _ = handoff.publish_and_announce(StandInCache(held=True), IMAGE, rank0)
    assert outcome.action_taken == "already-present" and "taught" not in outcome.as_dict()
    assert read_announcement(rank0.attempt_dir)["image_id"] == RANK0_ID


def test_without_teaching_the_daemon_is_left_as_it_is(rank0, monkeypatch):
    monkeypatch.setattr(handoff, "teach_daemon", lambda cache, image: pytest.fail("taught"))
    outcome, _ = handoff.publish_and_announce(StandInCache(), IMAGE, rank0, teach=False)
    assert "taught" not in outcome.as_dict()


def test_a_failed_publish_leaves_the_abort_marker_for_the_waiting_workers(rank0):
    with pytest.raises(OSError):
        handoff.publish_and_announce(StandInCache(OSError("no space left on the cache")), IMAGE, rank0)
    marker = read_abort_marker(rank0.attempt_dir)
    assert (marker["rank"], marker["node"]) == (0, "node1")
    assert "no space left on the cache" in marker["reason"]
    assert read_announcement(rank0.attempt_dir) is None


def test_a_worker_loads_the_image_rank_0_announces_once_it_is_there(rank0):
    announcing = threading.Timer(0.5, write_announcement, (rank0.attempt_dir, IMAGE, RANK0_ID))
    announcing.start()
    # Rank 0's heartbeat goes on meanwhile (its publish beats module.alive in push mode).
    with handoff.beating(rank0.heartbeat_file, interval=0.1):
        cache = StandInCache()
        outcome, announcement = handoff.load_announced(cache, IMAGE, rank0, marker_wait=0)
    assert cache.calls == [("load", RANK0_ID, IMAGE)]
    assert announcement["waited_seconds"] >= 0.4 and outcome.image_id == RANK0_ID


def test_a_worker_refuses_an_announcement_of_another_image(rank0):
    write_announcement(rank0.attempt_dir, "someone-else:latest", RANK0_ID)
    cache = StandInCache()
    with pytest.raises(AnnouncementError, match="someone-else:latest"):
        handoff.load_announced(cache, IMAGE, rank0, marker_wait=0)
    assert cache.calls == []


def test_a_worker_stops_waiting_at_rank_0s_abort_marker_blaming_rank_0(rank0):
    write_abort_marker(rank0.attempt_dir, 0, "node1", "rank 0 could not publish ci-dummy:latest: disk full")
    with pytest.raises(AnnouncementError) as stopped:
        handoff.load_announced(StandInCache(), IMAGE, rank0, marker_wait=0)
    assert stopped.value.aborted_by_rank == 0 and "disk full" in str(stopped.value)


def test_a_worker_gives_rank_0_up_once_its_publish_stopped_beating(tmp_path):
    rank0 = handoff.Rank0(str(tmp_path), "node1", heartbeat="module", heartbeat_stale=0.5)
    with pytest.raises(AnnouncementError, match=r"rank 0 \(node1\)'s module never wrote its heartbeat"):
        handoff.load_announced(StandInCache(), IMAGE, rank0, marker_wait=0)
