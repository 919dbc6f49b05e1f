"""A child process that stands for a SLURM step under scancel or a time limit: SLURM signals every process of the
step, the docker CLI children a module runs included."""

import contextlib
import os
import signal
import subprocess
import sys
import time


def in_a_step(script: str) -> subprocess.Popen:
    """``script`` in a child process of its own process group that takes SIGTERM as the run module does (a flag,
    no exit): the group stands for a SLURM step, which scancel and a time limit signal as a whole."""
    prelude = "import signal\nsignal.signal(signal.SIGTERM, lambda *_: None)\nprint('ready', flush=True)\n"
    # Out without the interpreter's shutdown, which restores SIGTERM's default action midway through the storm.
    ending = "\nimport os, sys\nsys.stdout.flush()\nos._exit(0)\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + script + ending],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def sigterms_until_it_ends(step: subprocess.Popen, after: float, every: float) -> str:
    assert step.stdout.readline() == "ready\n"  # its handler is in place
    time.sleep(after)
    while step.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(step.pid, signal.SIGTERM)
        time.sleep(every)
    return step.communicate()[0]
