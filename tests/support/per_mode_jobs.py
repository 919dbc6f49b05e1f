"""A module-scoped lab fixture's job, run once per pipeline mode.

tests/conftest.py runs every lab test once per mode through the function-scoped fixture `pipeline_mode`, which sets
SLURM_MULTI_MODE. A module-scoped fixture is set up before it and cached for the module: a job it ran itself would
be read by the [push] and the [pull] test alike, in whichever mode was set then (push), and pull mode would never be
tested. Such a fixture returns `once_per_mode(...)` instead, and each test asks it for its own mode's job.
"""

import re

import pytest

from tests.support.pipeline import MODE_ENV

# srun --label (pull mode's step: one ansible-playbook per node) puts the task number before each line of a node's
# Ansible output; push mode's one ansible-playbook, and the batch host's collect.yml, print their plays unlabelled.
_LABELLED_PLAY = re.compile(r"^\s*\d+: PLAY \[", re.MULTILINE)
_PLAY = re.compile(r"^PLAY \[", re.MULTILINE)


def mode_shown(output: str) -> str | None:
    """The mode a job's Ansible output shows it ran in: pull, push, or None when no play started."""
    if _LABELLED_PLAY.search(output):
        return "pull"
    return "push" if _PLAY.search(output) else None


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
        text = output(made[mode])
        shown = mode_shown(text)
        assert shown == mode, f"the {mode} test would read a job whose output shows {shown} mode: {text[-3000:]}"
        return made[mode]

    return job
