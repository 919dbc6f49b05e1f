"""The one root of the errors the user caused: what the CLI and the modules report as a message, not a traceback.

A `UserError` is bad input or a bad state of the cluster whose message tells the user what to fix: the CLI ends on
one with exit code 2, a module fails its task with its message; anything else keeps its traceback. Each subsystem's
errors subclass it beside the code that raises them, with no second base such as ValueError, so an `except
ValueError` stays what it reads as; a second base only where code we do not own decides by it (argparse's `type=`),
with a test in tests/unit/module_utils/test_user_error.py naming that need. An exception used for control flow
between our own functions is no UserError.
"""


class UserError(Exception):
    """An error the user caused and can fix; its message says what to fix."""
