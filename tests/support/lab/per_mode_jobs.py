"""A module-scoped lab fixture's jobs, run once per pipeline mode, one mode after the other or side by side.

tests/conftest.py runs every lab test once per mode through the function-scoped fixture `pipeline_mode`, which sets
SLURM_MULTI_MODE. A module-scoped fixture is set up before it and cached for the module: a job it ran itself would
be read by the [push] and the [pull] test alike, in whichever mode was set then (push), and pull mode would never be
tested. Such a fixture returns `once_per_mode(...)` or `both_modes_at_once(...)` instead, and each test asks it for
its own mode's job; `side_by_side` runs any set of jobs at once.
"""

import concurrent.futures
import os
import re

import pytest

from tests.support.lab.pipeline import MODE_ENV

MODES = ("push", "pull")
# srun --label (pull mode's step: one ansible-playbook per node) puts the task number before each line of a node's
# Ansible output; push mode's one ansible-playbook, and the batch host's collect.yml, print their plays unlabelled.
_LABELLED_PLAY = re.compile(r"^\s*\d+: PLAY \[", re.MULTILINE)
_PLAY = re.compile(r"^PLAY \[", re.MULTILINE)


def mode_shown(output: str) -> str | None:
    """The mode a job's Ansible output shows it ran in: pull, push, or None when no play started."""
    if _LABELLED_PLAY.search(output):
        return "pull"
    return "push" if _PLAY.search(output) else None


def in_mode(job, mode: str, output: str):
    """`job`, once its Ansible output (`output`) shows that it ran in `mode`."""
    shown = mode_shown(output)
    assert shown == mode, f"the {mode} test would read a job whose output shows {shown} mode: {output[-3000:]}"
    return job


# Two pipelines at a time fill the machine's two cores: 9 runs took 240 s one at a time, 188 s two and 214 s three at
# a time.
# SLURM_MULTI_TEST_AT_ONCE overrides it, to measure the suite both ways.
AT_ONCE = int(os.environ.get("SLURM_MULTI_TEST_AT_ONCE", "2"))


def side_by_side(runs: dict, at_once: int = AT_ONCE) -> dict:
    """{key: what runs[key]() returned}, `at_once` runs at a time, each in a thread of its own.

    For jobs that cannot collide (their own results dirs, job IDs, ports and containers) and whose tests assert no
    time bound that the others' load could break. A run that starts a pipeline passes it its mode itself: the
    threads share one process environment."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(at_once, len(runs))) as pool:
        futures = {key: pool.submit(run) for key, run in runs.items()}
        return {key: future.result() for key, future in futures.items()}


def once_per_mode(run, output):
    """`job(mode)` for a module-scoped fixture: what `run(mode)` returns, run with SLURM_MULTI_MODE set to that mode
    on the first call for the mode, cached for the others. On every call, `output(job)` (the job's Ansible output)
    must show that the job ran in that mode."""
    made = {}

    def job(mode):
        if mode not in made:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(MODE_ENV, mode)
                made[mode] = run(mode)
        return in_mode(made[mode], mode, output(made[mode]))

    return job


def both_modes_at_once(run, output, at_once: int = AT_ONCE):
    """Like once_per_mode, but the first call runs `run("push")` and `run("pull")` side by side (`side_by_side`,
    `at_once` at a time): `run(mode)` gives the mode to what it starts."""
    made = {}

    def job(mode):
        if not made:
            made.update(side_by_side({m: (lambda m=m: run(m)) for m in MODES}, at_once))
        return in_mode(made[mode], mode, output(made[mode]))

    return job
