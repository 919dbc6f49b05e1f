"""The one catch-all of a custom module's ``main()``: an error the user caused fails the task with its message, any
other exception with its traceback.

A module's ``run_module(module)`` ends with ``module.exit_json``, or ``module.fail_json`` where it words a failure
itself; both leave by ``SystemExit``, which is no ``Exception`` and passes through. A `UserError` (bad input, a bad
state of the node) it lets propagate fails the task with the error's message, which says what to fix. Anything else
is a bug or an unforeseen condition: the task fails with ``"<name> failed unexpectedly: <ExceptionType>: <error>"``
and the traceback in the result's ``exception`` (which ansible-core keeps when ``ANSIBLE_DISPLAY_TRACEBACK`` names
``error``).
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Optional, Union

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import step_record
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


def timed_step(module: Any, step: Optional[str]) -> None:
    """Make every result of ``module`` (exit_json and fail_json alike) carry ``step: {name, start, end}``: when
    this node's step (results/timeline.py's STEPS) started and ended, for the node's timeline. None records nothing."""
    if not step or getattr(module, "check_mode", False):
        return
    started = time.time()

    def with_step(leave: Callable[..., None]) -> Callable[..., None]:
        def leave_with_step(**result: Any) -> None:
            result.setdefault("step", dict(step_record(started), name=step))
            leave(**result)

        return leave_with_step

    module.exit_json = with_step(module.exit_json)
    module.fail_json = with_step(module.fail_json)


def run_reporting_unexpected_errors(
    module: Any,
    run_module: Callable[[Any], None],
    name: str,
    step: Union[None, str, Callable[[Any], Optional[str]]] = None,
    **failure_fields: Any,
) -> None:
    """Run ``run_module(module)``; a UserError or an unexpected exception fails the task through ``module.fail_json``.

    ``module`` is the module's AnsibleModule, ``name`` the module's name as an unexpected failure's message starts
    with it, and ``failure_fields`` (e.g. ``changed=False``) go into the failed result beside ``msg`` (and
    ``exception``).
    ``step`` names the timeline step the module's work is (or a function of the module giving it, None for
    none): its result then carries the step's times (`timed_step`).
    """
    timed_step(module, step(module) if callable(step) else step)
    try:
        run_module(module)
    except UserError as error:  # the message says what to fix: a traceback would only bury it
        module.fail_json(msg=str(error), **failure_fields)
    except Exception as error:  # noqa: BLE001 - the one place unexpected errors become a failed task
        module.fail_json(
            msg=f"{name} failed unexpectedly: {type(error).__name__}: {error}",
            exception=traceback.format_exc(),
            **failure_fields,
        )
