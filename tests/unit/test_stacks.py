"""A container's stacks (module_utils/run/stacks.py): py-spy's dumps read, stacks.txt written, secrets masked.

The dumps and py-spy's errors are real, recorded from a lab container (tests/fixtures/stacks/README.md).
"""

import json
import os
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.stacks import (
    NOT_PYTHON,
    format_stacks,
    mask_stacks,
    parse_pyspy_dump,
    pyspy_error,
    write_stacks,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stacks"
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
    assert "process 24148" in said and "as root" in said and "setcap cap_sys_ptrace+ep" in said
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
