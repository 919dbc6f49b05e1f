"""The one error type users of slurm-multi catch, and the module_utils errors that become it."""

from __future__ import annotations

from ansible.module_utils.image.build import ImageBuildError
from ansible.module_utils.image.build_manifest import ManifestError
from ansible.module_utils.image.build_secrets import BuildSecretError
from ansible.module_utils.image.dockerfile_selection import DockerfileSelectionError
from ansible.module_utils.image.names import ImageNameError
from ansible.module_utils.results.collection import ResultsCollectionError
from ansible.module_utils.run.context import RunContextError
from ansible.module_utils.run.launchers import LauncherError
from ansible.module_utils.run.model_scripts import ModelScriptsError
from ansible.module_utils.run.secrets_env import SecretsError
from ansible.module_utils.slurm.allocation import AllocationError


class SbatchError(Exception):
    """A SLURM option or command that cannot be used, with what to do instead (slurm_multi.submission.sbatch's)."""


class SlurmMultiError(Exception):
    """Bad input or an infrastructure problem, with a message that says what to do; exit code 2 on the CLI."""


# The shared logic's own errors about the user's input: each says what to fix, and reaches the user as a
# SlurmMultiError with the same message.
INPUT_ERRORS = (
    RunContextError,
    ImageNameError,
    ManifestError,
    SbatchError,
    SecretsError,
    ResultsCollectionError,
    AllocationError,
    ImageBuildError,
    BuildSecretError,
    DockerfileSelectionError,
    ModelScriptsError,
    LauncherError,
)
