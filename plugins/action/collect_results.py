"""Action: the collect_results module's work (library/collect_results.py documents it), done in Ansible's own
worker on the controller; the logic is module_utils/results/collect_task.py's."""

from ansible.plugins.action import ActionBase

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collect_task import (
    ARGUMENT_SPEC,
    collect_results,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError


class ActionModule(ActionBase):
    """The collect runs on the controller anyway: as a module it would start a Python and unpack a payload for a
    few milliseconds of work, on every job."""

    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        _, params = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        try:
            collected, warnings = collect_results(params, self._task.check_mode)
        except UserError as error:  # the message says what to fix, as the module's runner reports it
            return dict(result, failed=True, changed=False, msg=str(error))
        for warning in warnings:
            self._display.warning(warning)
        return dict(result, **collected)
