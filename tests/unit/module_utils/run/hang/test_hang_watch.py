"""The hang watchdog's logic (module_utils/run/hang/watch.py): what counts as progress, and rank 0's judgement.

The containers' CPU is read through `docker top`; here a recorded reading stands in for it (no container runs), so a
node's progress is its log's growth and its CPU readings, and the judge's every node's count: the lab tests
(tests/integration/run/test_hang_watchdog_lab.py) run the whole of it on real containers. One test here samples a
real container's progress as the job's ordinary user would, through the session's private Docker daemon.
"""

import contextlib
import grp
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.abort_marker import (
    read_abort_marker,
    write_abort_marker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang import watch as hang_watch
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.watch import (
    PROGRESS_FILE,
    Activity,
    HangJudge,
    HangWatch,
    NodeProgress,
    process_activity,
    read_progress_count,
    sample_interval,
)
from tests.support.ansible import ROOT
from tests.support.lab.slow_disk import SLOW_READ_SCRIPT, throttled_read_options
from tests.support.users.local_users import TEAM, USER, ensure_user, run_as, system_python

NODES = ("node1", "node2", "node3")


def test_the_run_is_hung_once_no_node_moved_for_the_timeout():
    judge = HangJudge(NODES, hang_timeout=10, now=0)
    assert judge.observe({"node1": 1, "node2": 1, "node3": 1}, now=1) is None
    assert judge.observe({"node1": 1, "node2": 1, "node3": 1}, now=10.9) is None
    assert judge.observe({"node1": 1, "node2": 1, "node3": 1}, now=11) == "hang: no rank made progress for 10 s"


def test_one_node_moving_keeps_the_whole_run_alive():
    # The quiet but busy rank: the others wait for it in a collective, it computes.
    judge = HangJudge(NODES, hang_timeout=10, now=0)
    for second in range(1, 60):
        assert judge.observe({"node1": 1, "node2": 1, "node3": second}, now=second) is None


def test_a_node_that_never_wrote_its_progress_counts_as_standing_still():
    judge = HangJudge(NODES, hang_timeout=5, now=0)
    assert judge.observe({"node1": 3, "node2": 3, "node3": None}, now=1) is None
    assert judge.observe({"node1": 3, "node2": 3, "node3": None}, now=6) is not None


def test_samples_come_five_per_timeout_one_to_ten_seconds_apart():
    assert sample_interval(2) == 1.0
    assert sample_interval(20) == 4.0
    assert sample_interval(300) == 10.0


def _progress(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("")
    return log, NodeProgress("slurm-multi-no-such-container", str(log), str(tmp_path / PROGRESS_FILE), "node2", 1)


def test_output_is_progress_and_silence_with_no_process_running_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(hang_watch, "container_activity", lambda container: {})
    log, progress = _progress(tmp_path)
    assert progress.sample(now=0)  # the first sample starts the count
    assert not progress.sample(now=1)
    log.write_text("step 1\n")
    assert progress.sample(now=2)
    assert not progress.sample(now=3)
    assert progress.count == 2
    assert read_progress_count(str(tmp_path / PROGRESS_FILE)) == 2


def test_cpu_used_is_progress_and_a_process_blocked_in_a_call_is_not(tmp_path, monkeypatch):
    now = {"activity": Activity(1.0, 0, False)}
    monkeypatch.setattr(hang_watch, "container_activity", lambda container: {4242: now["activity"]})
    _, progress = _progress(tmp_path)
    progress.sample(now=0)
    now["activity"] = Activity(1.01, 0, False)  # 1% of a core over a second: torchrun's agent polling its worker
    assert not progress.sample(now=1)
    now["activity"] = Activity(1.91, 0, False)
    assert progress.sample(now=2)


def test_storage_read_or_written_and_a_runnable_process_are_progress(tmp_path, monkeypatch):
    # A first torch import on a loaded node waits on the disk, or for a core: no CPU used, and no hang either.
    now = {"activity": Activity(1.0, 4096, False)}
    monkeypatch.setattr(hang_watch, "container_activity", lambda container: {4242: now["activity"]})
    _, progress = _progress(tmp_path)
    progress.sample(now=0)
    now["activity"] = Activity(1.0, 8 << 20, False)
    assert progress.sample(now=1)
    assert not progress.sample(now=2)
    now["activity"] = Activity(1.0, 8 << 20, True)
    assert progress.sample(now=3)


def test_a_process_starting_or_ending_in_the_container_is_progress(tmp_path, monkeypatch):
    idle = Activity(1.0, 0, False)
    processes = {"pids": {100: idle}}
    monkeypatch.setattr(hang_watch, "container_activity", lambda container: dict(processes["pids"]))
    _, progress = _progress(tmp_path)
    progress.sample(now=0)
    processes["pids"] = {100: idle, 101: Activity(0.0, 0, False)}  # torchrun started its worker
    assert progress.sample(now=1)
    assert not progress.sample(now=2)


def test_a_processs_own_cpu_storage_and_state_are_read_from_proc(tmp_path):
    before = process_activity(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    with open(tmp_path / "written", "wb") as written:
        written.write(b"x" * (1 << 20))
        os.fsync(written.fileno())
    after = process_activity(os.getpid())
    assert after.cpu - before.cpu >= 0.2 and after.runnable  # reading its own /proc, it runs
    assert after.storage_bytes > before.storage_bytes
    assert process_activity(2**22 + 1) is None  # past the largest PID


def test_a_missing_or_half_written_progress_file_reads_as_none(tmp_path):
    path = tmp_path / PROGRESS_FILE
    assert read_progress_count(str(path)) is None
    path.write_text('{"count": 3')
    assert read_progress_count(str(path)) is None
    path.write_text('["count", 3]')
    assert read_progress_count(str(path)) is None
    path.write_text(json.dumps({"count": 3}))
    assert read_progress_count(str(path)) == 3


def test_rank_0_judges_every_nodes_progress_file_and_a_worker_only_writes_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(hang_watch, "container_activity", lambda container: {})
    node_dirs = {node: str(tmp_path / node) for node in NODES}
    for path in node_dirs.values():
        os.makedirs(path)
        open(os.path.join(path, "run.log"), "w").close()
    watches = [
        HangWatch("slurm-multi-no-such", os.path.join(node_dirs[node], "run.log"), node_dirs, node, rank, 4, now=0)
        for rank, node in enumerate(NODES)
    ]
    assert watches[1].judge is None
    now = 0.0
    while now < 30:
        for watch in watches[1:]:
            watch.tick(now)
        if now < 10:  # node3 writes output for ten seconds, then all stand still
            with open(os.path.join(node_dirs["node3"], "run.log"), "a") as log:
                log.write("x\n")
        hang = watches[0].tick(now)
        if hang:
            break
        now += 0.5
    assert hang == "hang: no rank made progress for 4 s"
    assert 14 <= now <= 16  # node3's last output near 10 s, seen within a sample; then 4 s of stillness


def test_the_hangs_marker_says_its_kind_and_the_first_marker_stands(tmp_path):
    assert write_abort_marker(str(tmp_path), 0, "node1", "hang: no rank made progress for 4 s", kind="hang")
    assert not write_abort_marker(str(tmp_path), 2, "node3", "the container exited with code 1")
    assert read_abort_marker(str(tmp_path)) == {
        "rank": 0,
        "node": "node1",
        "reason": "hang: no rank made progress for 4 s",
        "kind": "hang",
    }


_IMPORT = (
    f"import sys; sys.path.insert(0, {str(ROOT / 'collections')!r}); "
    "from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.watch import NodeProgress, "
    "process_activity"
)

# As the job's user: sample the container's progress once a second, printing (when, progressed) a line each.
_SAMPLER = (
    _IMPORT
    + """
import json, time
progress = NodeProgress(sys.argv[1], sys.argv[2], sys.argv[3], "node1", 0)
end = time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    print(json.dumps([time.time(), progress.sample(time.monotonic())]), flush=True)
    time.sleep(1)
"""
)


def test_a_process_of_another_users_storage_is_unknown_to_the_jobs_user_not_zero():
    ensure_user(USER)
    rank = subprocess.Popen(["sleep", "60"])  # a container's process: root's, as Docker runs them
    try:
        seen = run_as(USER, [system_python(), "-c", f"{_IMPORT}; print(process_activity({rank.pid}).storage_bytes)"])
        assert seen.stdout.strip() == "None", seen.stderr
    finally:
        rank.kill()
        rank.wait()


@contextlib.contextmanager
def _daemon_for_the_docker_group(dockerd):
    """The private daemon's socket usable by the docker group's members (the job's user), as a node's is."""
    docker = grp.getgrnam("docker").gr_gid
    root_mode, socket_stat = stat.S_IMODE(dockerd.root.stat().st_mode), dockerd.socket.stat()
    dockerd.root.chmod(root_mode | 0o011)
    os.chown(dockerd.socket, 0, docker)
    dockerd.socket.chmod(0o660)
    try:
        yield
    finally:
        os.chown(dockerd.socket, socket_stat.st_uid, socket_stat.st_gid)
        dockerd.socket.chmod(stat.S_IMODE(socket_stat.st_mode))
        dockerd.root.chmod(root_mode)


def _log_times(dockerd, container) -> dict:
    """{line: when the container wrote it (epoch seconds)} from `docker logs -t`."""
    times = {}
    for line in dockerd.docker("logs", "-t", container).stdout.splitlines():
        stamp, _, text = line.partition(" ")
        times[text] = datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00").timestamp()
    return times


def test_as_the_jobs_user_a_rank_reading_a_slow_disk_makes_progress_and_then_standing_still_does_not(
    private_dockerd, busybox_image
):
    # The rank's /proc/<pid>/io is root's: only the container's cgroup shows its reads advance.
    user = ensure_user(USER, groups=(TEAM, "docker"))
    watch_dir = Path(tempfile.mkdtemp(prefix="slurm-multi-watch-"))  # the user's own, where it can reach it
    os.chown(watch_dir, user.pw_uid, user.pw_gid)
    (watch_dir / "run.log").write_text("")  # the model prints nothing while it reads
    container = f"slurm-multi-test-slow-reads-{uuid.uuid4().hex[:8]}"
    throttle = throttled_read_options(str(private_dockerd.root / "data"))
    private_dockerd.docker(
        "run", "-d", "--name", container, *throttle, busybox_image[0], "sh", "-c", SLOW_READ_SCRIPT, "sh", "5"
    )
    try:
        with _daemon_for_the_docker_group(private_dockerd):
            sampled = run_as(
                USER,
                [system_python(), "-c", _SAMPLER, container, str(watch_dir / "run.log"), str(watch_dir / "p"), "11"],
                env={"DOCKER_HOST": private_dockerd.host, "PATH": os.environ["PATH"]},
            )
        assert sampled.returncode == 0, sampled.stderr
        samples = [json.loads(line) for line in sampled.stdout.splitlines()]
        written = _log_times(private_dockerd, container)
        assert "read" in written, ("the read did not end within the samples", written)
        reading = [progressed for at, progressed in samples if written["reading"] + 1 < at < written["read"]]
        still = [progressed for at, progressed in samples if at > written["read"] + 1.5]
        assert len(reading) >= 3 and all(reading), samples
        assert len(still) >= 2 and not any(still), samples
    finally:
        private_dockerd.docker("rm", "-f", container, check=False)
        shutil.rmtree(watch_dir)
