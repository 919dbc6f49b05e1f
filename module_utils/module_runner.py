"""The one catch-all of a custom module's ``main()``: an unexpected exception becomes a failed task with its traceback.

A module's ``run_module(module)`` reports its expected failures itself (``module.fail_json`` with a clear
message) and ends with ``module.exit_json``; both leave by ``SystemExit``, which is no ``Exception`` and passes
through. Anything else is a bug or an unforeseen condition: the task fails with
``"<name> failed unexpectedly: <ExceptionType>: <error>"`` and the traceback in the result's ``exception``.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable


def run_reporting_unexpected_errors(
    module: Any, run_module: Callable[[Any], None], name: str, **failure_fields: Any
) -> None:
    """Run ``run_module(module)``; an unexpected exception fails the task through ``module.fail_json``.

    ``module`` is the module's AnsibleModule, ``name`` the module's name as the failure message starts with it,
    and ``failure_fields`` (e.g. ``changed=False``) go into the failed result beside ``msg`` and ``exception``.
    """
    try:
        run_module(module)
    except Exception as error:  # noqa: BLE001 - the one place unexpected errors become a failed task
        module.fail_json(
            msg=f"{name} failed unexpectedly: {type(error).__name__}: {error}",
            exception=traceback.format_exc(),
            **failure_fields,
        )
