"""The pipeline's mode, one fact: push (one ansible-playbook on the batch host drives every node, each task an srun
step) or pull (one srun step starts an ansible-playbook on every node, each against itself)."""

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS

PUSH = "push"
PULL = "pull"
MODES = (PUSH, PULL)
DEFAULT_MODE = SETTING_DEFAULTS["mode"]  # the settings' one home (push)
