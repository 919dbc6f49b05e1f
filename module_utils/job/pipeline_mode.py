"""The pipeline's mode, one fact: push (one ansible-playbook on the batch host drives every node, each task an srun
step) or pull (one srun step starts an ansible-playbook on every node, each against itself).

Set once per run: group_vars/all.yml's `mode`, whose `pull_mode` is the one reading of it in the roles and plays.
The CLI, the job spec, the job script and the node-play guard read these names.
"""

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS

PUSH = "push"
PULL = "pull"
MODES = (PUSH, PULL)
DEFAULT_MODE = SETTING_DEFAULTS["mode"]  # the settings' one home (push)
