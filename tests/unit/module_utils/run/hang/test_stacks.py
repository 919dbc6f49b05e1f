"""A container's stacks (module_utils/run/hang/stacks.py): py-spy's dumps read, stacks.txt written, secrets masked.

The dumps and py-spy's errors are real, recorded from a lab container (tests/fixtures/stacks/README.md). A frame's
source line comes only from a file inside the rank's own root, whatever name the model gave the frame: shown on a
chrooted Python dumped by py-spy, a container of a private Docker daemon, and an ordinary user's host process.
"""

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang import stacks as stacks_module
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.stacks import (
    NOT_PYTHON,
    find_below_root_without_links,
    format_stacks,
    mask_stacks,
    parse_pyspy_dump,
    pyspy_error,
    source_line,
    write_stacks,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import find_pyspy
from tests.support.users.local_users import USER, ensure_user, start_as, system_python

FIXTURES = Path(__file__).resolve().parents[4] / "fixtures" / "stacks"
SECRET = "hf_SECRETVALUE123"


def _threads(name, pid=0):
    """The recorded dump ``name`` as stacks.json's threads, with the host's view recorded beside it."""
    view = json.loads((FIXTURES / f"host-view-{name}.json").read_text())
    running = {int(thread): state for thread, state in view["running"].items()}
    return parse_pyspy_dump((FIXTURES / f"pyspy-dump-{name}.json").read_text(), pid, view["main_thread"], running)


def _recorded_stacks():
    """The recorded container's stacks as take_container_stacks gives them, before masking."""
    top = (FIXTURES / "docker_top.txt").read_text()
    (shell, _, shell_command), (train, _, train_command), (idle, _, idle_command), (sleeper, _, sleep_command) = [
        line.split(None, 2) for line in top.splitlines()[1:]
    ]

    def process(pid, command, threads=None, error=None):
        return {"pid": int(pid), "ppid": int(shell), "command": command, "rank": 2, "local_rank": 0,
                "python": threads is not None, "error": error, "threads": threads or []}  # fmt: skip

    train_threads = _threads("threaded")
    train_threads[0]["frames"][1]["source"] = f'load_batch(0, token="{SECRET}")'  # as read from train.py:16
    return {
        "node": "node3",
        "rank": 2,
        "container": "slurm-multi-4242-r2",
        "why": "hang",
        "taken_at": 1796384014.5,
        "processes": [
            process(shell, shell_command, error=NOT_PYTHON),
            process(train, train_command, train_threads),
            process(idle, idle_command, _threads("idle")),
            process(sleeper, sleep_command, error=NOT_PYTHON),
        ],
        "docker_top": top.rstrip("\n"),
        "log_tail": ["step 3 loss 0.25"],
    }


def test_the_main_thread_comes_first_with_its_frames_innermost_first():
    main, prefetcher = _threads("threaded")
    assert (main["name"], main["main"], prefetcher["name"], prefetcher["main"]) == (
        "MainThread",
        True,
        "prefetcher",
        False,
    )
    assert [(frame["function"], frame["line"]) for frame in main["frames"]] == [("load_batch", 12), ("<module>", 16)]
    assert main["frames"][0]["file"] == "/myworkspace/train.py"


def test_a_sleeping_thread_is_idle_and_a_computing_one_is_not_though_py_spy_calls_both_active():
    recorded = json.loads((FIXTURES / "pyspy-dump-threaded.json").read_text())
    assert all(thread["active"] for thread in recorded)  # py-spy from the host cannot see a container's threads
    main, prefetcher = _threads("threaded")
    assert (main["idle"], prefetcher["idle"]) == (True, False)


def test_without_the_hosts_view_a_threads_idle_state_is_unknown():
    threads = parse_pyspy_dump((FIXTURES / "pyspy-dump-threaded.json").read_text(), 0)
    assert [thread["idle"] for thread in threads] == [None, None]


def test_a_thread_without_a_name_is_the_main_thread_by_its_id_in_the_container():
    recorded = json.loads((FIXTURES / "pyspy-dump-idle.json").read_text())
    assert recorded[0]["thread_name"] is None  # idle.py never imports threading
    (thread,) = _threads("idle")
    assert (thread["name"], thread["main"], thread["idle"]) == ("MainThread", True, True)
    assert thread["frames"][0]["function"] == "socket.accept"


def test_each_frame_gets_its_source_line_from_the_processs_own_file():
    # This process stands for the container's: its /proc/<pid>/root is /, where the recorded script is.
    dump = (
        (FIXTURES / "pyspy-dump-threaded.json").read_text().replace("/myworkspace/train.py", str(FIXTURES / "train.py"))
    )
    main = parse_pyspy_dump(dump, os.getpid())[0]
    assert [frame["source"] for frame in main["frames"]] == ["time.sleep(600)", f'load_batch(0, token="{SECRET}")']


def test_a_frame_of_a_file_the_process_does_not_have_gets_no_source_line():
    main = parse_pyspy_dump((FIXTURES / "pyspy-dump-threaded.json").read_text(), os.getpid())[0]
    assert [frame["source"] for frame in main["frames"]] == [None, None]  # no /myworkspace here


def test_a_process_without_python_is_said_to_be_not_a_python_process():
    assert pyspy_error((FIXTURES / "pyspy-dump-not-python.stderr").read_text(), 24150) == NOT_PYTHON


def test_a_trace_refused_to_another_user_names_the_process_and_the_fix():
    said = pyspy_error((FIXTURES / "pyspy-dump-permission-denied.stderr").read_text(), 24148)
    assert said == f"py-spy may not read process 24148: {stacks_module.TRACE_REFUSED}"  # test_pyspy_permissions.py
    assert "sudo env" not in said  # py-spy's advice is for a shell


def test_a_py_spy_failure_is_its_first_line_without_the_backtrace():
    stderr = (  # py-spy 0.4.3 with RUST_BACKTRACE=1, for a process that ended before its dump
        "Error: Failed to get process executable name. Check that the process is running.\n\nCaused by:\n"
        "    0: No such file or directory (os error 2)\n\nStack backtrace:\n   0: <E as anyhow::context>\n"
    )
    assert pyspy_error(stderr, 999999) == "Failed to get process executable name. Check that the process is running."


def test_the_text_heads_each_process_with_its_rank_pid_and_command():
    text = format_stacks(_recorded_stacks())
    assert text.splitlines()[0] == "node3 (rank 2): slurm-multi-4242-r2, hang, 2026-12-04 11:33:34 UTC"
    train = next(line for line in text.splitlines() if "train.py --token" in line and line.startswith("=="))
    assert train.startswith("== rank 2, pid ")


def test_the_text_gives_each_threads_state_and_its_frames_with_their_source_lines():
    lines = format_stacks(_recorded_stacks()).splitlines()
    start = lines.index("   Thread MainThread (idle)")
    assert lines[start : start + 6] == [
        "   Thread MainThread (idle)",
        "      load_batch (/myworkspace/train.py:12)",
        "      <module> (/myworkspace/train.py:16)",
        f'          load_batch(0, token="{SECRET}")',
        "   Thread prefetcher (active)",
        "      prefetch.<locals>.<genexpr> (/myworkspace/train.py:8)",
    ]


def test_a_process_without_stacks_says_why_and_the_container_log_closes_the_text():
    text = format_stacks(_recorded_stacks())
    assert f"   ({NOT_PYTHON})" in text
    assert text.endswith("== the container's last log lines\nstep 3 loss 0.25\n")


def test_a_secret_in_a_command_line_and_a_source_line_reaches_neither_file(tmp_path):
    stacks = _recorded_stacks()
    assert SECRET in json.dumps(stacks)  # the recorded command line and source line hold it
    text_path, json_path = write_stacks(str(tmp_path), mask_stacks(stacks, [SECRET]))
    text, recorded = Path(text_path).read_text(), Path(json_path).read_text()
    assert SECRET not in text and SECRET not in recorded
    assert "--token ********" in text and 'load_batch(0, token="********")' in text
    train = json.loads(recorded)["processes"][1]
    assert train["command"].endswith("--token ********")
    assert train["threads"][0]["frames"][1]["source"] == 'load_batch(0, token="********")'


def test_stacks_taken_on_demand_go_to_their_own_files_beside_a_hangs(tmp_path):
    written = write_stacks(str(tmp_path), _recorded_stacks(), name="stacks-20261204T113000")
    assert written == (str(tmp_path / "stacks-20261204T113000.txt"), str(tmp_path / "stacks-20261204T113000.json"))
    assert json.loads(Path(written[1]).read_text())["container"] == "slurm-multi-4242-r2"


# ------------------------------------------------------------------ source lines only from the rank's own root

HOST_SECRET = "host-only ssh key line 9f3c"


@pytest.fixture
def host_secret():
    """A host file only root may read (0600), in a dir every user may enter, its secret on every line."""
    if os.geteuid() != 0:
        pytest.skip("chroot, mount namespaces and a second user need root")
    place = Path(tempfile.mkdtemp(prefix="slurm-multi-host-"))
    place.chmod(0o755)
    secret = place / "id_rsa"
    secret.write_text(f"{HOST_SECRET}\n" * 5)
    secret.chmod(0o600)
    yield secret
    shutil.rmtree(place)


@pytest.fixture(params=["openat2", "without openat2"])
def kernel(request, monkeypatch):
    """Each way a name is resolved in the rank's root: openat2 (Linux 5.6+), and the walk of an older kernel."""
    monkeypatch.setattr(stacks_module, "_openat2_missing", request.param == "without openat2")
    return request.param


def _climbing(path: Path) -> str:
    """The name a model gives a frame to reach ``path`` from any root: up past the top, then down."""
    return "/../../../../../.." + str(path)


TRAIN = """\
import sys, time
def wait_in_a_file_of_its_naming(name):
    exec(compile("open('/tmp/ready', 'w').close()\\nwhile True:\\n    time.sleep(1)\\n", name, "exec"), {"time": time})
wait_in_a_file_of_its_naming(sys.argv[1])
"""


@contextlib.contextmanager
def _chrooted_python(tree: Path, frame_file: str):
    """/usr/bin/python3 running /app/train.py chrooted into ``tree`` (the host's /usr bound into it, in a mount
    namespace of its own), blocked in a frame whose file is ``frame_file``: a rank whose root is not the host's."""
    (tree / "app").mkdir(parents=True)
    (tree / "tmp").mkdir()
    (tree / "app" / "train.py").write_text(TRAIN)
    binds = []
    for top in ("usr", "bin", "lib", "lib32", "lib64", "sbin"):
        host = Path("/") / top
        if host.is_symlink():
            (tree / top).symlink_to(os.readlink(host))
        elif host.is_dir():
            (tree / top).mkdir()
            binds.append(f'mount --bind /{top} "$1/{top}"')
    script = " && ".join([*binds, 'exec chroot "$1" /usr/bin/python3 /app/train.py "$2"'])
    rank = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", tree, frame_file]
    )
    try:
        deadline = time.monotonic() + 30
        while not (tree / "tmp" / "ready").exists():
            assert rank.poll() is None and time.monotonic() < deadline, "the chrooted python did not start"
            time.sleep(0.05)
        yield rank.pid
    finally:
        rank.kill()
        rank.wait()


def test_a_frame_naming_a_file_above_a_chrooted_ranks_root_shows_no_line_of_it(tmp_path, host_secret, kernel):
    name = _climbing(host_secret)
    with _chrooted_python(tmp_path / "root", name) as pid:
        dumped = subprocess.run([find_pyspy(), "dump", "--pid", str(pid), "--json"], capture_output=True, text=True)
        assert dumped.returncode == 0, dumped.stderr
        threads = parse_pyspy_dump(dumped.stdout, pid)
    frames = threads[0]["frames"]
    assert (frames[0]["file"], frames[0]["source"]) == (name, None)
    # The rank's own file, inside its root, still gives its line.
    assert frames[1]["file"] == "/app/train.py" and frames[1]["source"].startswith("exec(compile(")
    stacks = {"processes": [{"pid": pid, "command": "python3", "threads": threads}]}
    assert HOST_SECRET not in json.dumps(threads) and HOST_SECRET not in format_stacks(stacks)


def test_a_link_in_a_containers_files_to_a_host_file_shows_no_line_of_it(
    private_dockerd, busybox_image, host_secret, kernel
):
    container = f"slurm-multi-test-link-{uuid.uuid4().hex[:8]}"
    script = f"mkdir -p /tmp && ln -s {host_secret} /tmp/weights.py && echo 'own line' > /tmp/own.py && exec sleep 60"
    private_dockerd.docker("run", "-d", "--name", container, busybox_image[0], "sh", "-c", script)
    try:
        deadline = time.monotonic() + 30
        while "sleep" not in private_dockerd.docker("top", container, check=False).stdout:
            assert time.monotonic() < deadline, private_dockerd.docker("logs", container, check=False).stderr
            time.sleep(0.1)
        pid = int(private_dockerd.docker("inspect", "--format", "{{.State.Pid}}", container).stdout)
        assert source_line(pid, "/tmp/weights.py", 1, {}) is None  # the link's absolute target is the container's
        assert source_line(pid, _climbing(host_secret), 1, {}) is None
        assert source_line(pid, "/tmp/own.py", 1, {}) == "own line"
    finally:
        private_dockerd.docker("rm", "-f", container, check=False)


def test_a_host_process_rank_shows_no_line_of_a_host_file_it_may_not_read_itself(host_secret):
    # A runtime without containers: the rank's root is the host's /, so the host's files are its files, but only
    # those it may read. The stacks are taken by root here, who could read them all.
    ensure_user(USER)
    shared = host_secret.parent / "shared.py"
    shared.write_text("shared line\n")
    shared.chmod(0o644)
    rank = start_as(
        USER, [system_python(), "-c", "import time; print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE
    )
    try:
        rank.stdout.readline()  # running as the user now, no longer as root's setpriv
        assert source_line(rank.pid, str(host_secret), 1, {}) is None
        assert source_line(rank.pid, _climbing(host_secret), 1, {}) is None
        assert source_line(rank.pid, str(shared), 1, {}) == "shared line"
    finally:
        rank.kill()
        rank.wait()


def test_without_openat2_a_name_that_climbs_or_passes_a_link_is_refused(tmp_path):
    root = tmp_path / "root"
    (root / "app").mkdir(parents=True)
    (root / "app" / "train.py").write_text("step()\n")
    (root / "app" / "linked.py").symlink_to("/etc/hostname")
    (root / "lib").symlink_to("app")
    (tmp_path / "above.py").write_text("above the root\n")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        found = find_below_root_without_links(root_fd, "/app/train.py")
        assert os.readlink(f"/proc/self/fd/{found}") == str(root / "app" / "train.py")
        os.close(found)
        for name in ("/../above.py", "/app/../../above.py", "/app/linked.py", "/lib/train.py"):
            with pytest.raises(PermissionError):
                os.close(find_below_root_without_links(root_fd, name))
    finally:
        os.close(root_fd)
