"""The one root of the errors the user caused: what the CLI and the modules report as a message, not a traceback.

A `UserError` is bad input (a job ID, a context, a model card, a SLURM option) or a bad state of the cluster (a node
without Docker, a results dir another user owns, a barrier a node never reached) whose message tells the user what
to fix. The CLI ends on one with exit code 2 and its message; a module fails its task with its message
(module_runner.run_reporting_unexpected_errors). Anything else is a bug or an unforeseen condition and keeps its
traceback.

The rule, for the node side and the controller alike:

* An error the user can fix is a UserError: a subclass of it, or of a subsystem's own class that is one
  (BarrierError, ImageCacheError), defined beside the code that raises it. It is then reported right everywhere
  without being listed anywhere. The controller's are UserErrors the same way; its Python API raises
  slurm_multi.errors.SlurmMultiError, a UserError too, as the one class its callers catch.
* UserError is its only root: no second base such as ValueError or RuntimeError. A caller that handles it catches
  its class, and an `except ValueError` stays what it reads as: int(), json.loads and the like failing. A second
  base is allowed only where code we do not own decides by it (argparse's `type=` functions must raise ValueError,
  TypeError or ArgumentTypeError to print a usage error), with a test named after that need; none needs one, and
  tests/unit/module_utils/test_user_error.py refuses one without such a test.
* An exception used for control flow between our own functions (a connection attempt worth retrying, a busy
  upload, a line the barrier's protocol refuses, a failed queueing that carries the held job to cancel) is no
  UserError: it subclasses Exception, and the caller that catches it raises the worded error if the user must know.
"""


class UserError(Exception):
    """An error the user caused and can fix; its message says what to fix."""
