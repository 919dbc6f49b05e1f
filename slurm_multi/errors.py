"""The package's own errors the user caused, under the one root of them all (module_utils/user_error.py).

The CLI ends on any UserError with exit code 2 and its message; the API turns the shared logic's into a
SlurmMultiError, the one error type its callers catch.
"""

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


class SbatchError(UserError):
    """A SLURM option or command that cannot be used, with what to do instead (slurm_multi.submission.sbatch's)."""


class SlurmMultiError(UserError):
    """Bad input or an infrastructure problem, with a message that says what to do; exit code 2 on the CLI."""
