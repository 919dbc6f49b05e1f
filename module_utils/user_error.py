"""The one root of the errors the user caused: what the CLI and the modules report as a message, not a traceback.

A `UserError` is bad input (a job ID, a context, a model card, a SLURM option) or a bad state of the cluster (a node
without Docker, a results dir another user owns, a barrier a node never reached) whose message tells the user what
to fix. The CLI ends on one with exit code 2 and its message; a module fails its task with its message
(module_runner.run_reporting_unexpected_errors). Anything else is a bug or an unforeseen condition and keeps its
traceback.

So a new error the user can fix subclasses UserError (beside ValueError or RuntimeError where callers catch
those) and is reported right everywhere without being listed anywhere. An exception used for control flow between
our own functions (a retry, a busy upload, a broken stream that a caller turns into a worded error) is no UserError.
"""


class UserError(Exception):
    """An error the user caused and can fix; its message says what to fix."""
