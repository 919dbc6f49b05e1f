"""The one catch-all of a custom module's ``main()``: an error the user caused fails the task with its message, any
other exception with its traceback (``exit_json``/``fail_json`` leave by ``SystemExit``, which passes through)."""

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
    """Run ``run_module(module)``; a UserError or an unexpected exception fails the task through ``module.fail_json``
    with ``failure_fields``. ``step``: the timeline step the module's work is, whose times its result then carries."""
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
