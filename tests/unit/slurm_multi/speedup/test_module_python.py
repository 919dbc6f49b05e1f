"""slurm-multi-module-python (slurm_multi/speedup/), the inventory's interpreter for modules: the venv's Python, a
pipelined module read from /dev/stdin (in blocks), any other use passed through unchanged."""

import socket
import subprocess

from tests.support.ansible import BIN

MODULE_PYTHON = BIN / "slurm-multi-module-python"
REPORT = "import sys; print(sys.executable, sys.argv)\n"


def test_a_pipelined_module_on_stdin_runs_in_the_python_beside_it():
    ran = subprocess.run([str(MODULE_PYTHON)], input=REPORT, capture_output=True, text=True, check=True)
    assert ran.stdout.split(None, 1) == [str(BIN / "python3"), "['/dev/stdin']\n"]


def test_a_module_file_with_arguments_runs_as_python_would_run_it(tmp_path):
    # As an async task runs its wrapper, or a module's shebang names this interpreter.
    (tmp_path / "module.py").write_text(REPORT)
    ran = subprocess.run(
        [str(MODULE_PYTHON), str(tmp_path / "module.py"), "jid", "60"], capture_output=True, text=True, check=True
    )
    assert ran.stdout == f"{BIN / 'python3'} ['{tmp_path / 'module.py'}', 'jid', '60']\n"


def test_a_module_on_a_socket_stdin_still_runs():
    # /dev/stdin cannot be opened when stdin is a socket (ENXIO): Python then reads the script from stdin itself.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(REPORT.encode())
        ours.shutdown(socket.SHUT_WR)
        ran = subprocess.run([str(MODULE_PYTHON)], stdin=theirs, capture_output=True, text=True, check=True)
    assert ran.stdout.split(None, 1) == [str(BIN / "python3"), "['']\n"] and ran.stderr == ""
