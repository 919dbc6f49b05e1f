"""Action: the preflight_nonce module's work (library/preflight_nonce.py documents it), done in Ansible's own worker
on the controller; the logic is module_utils/node/preflight.py's."""

from ansible.plugins.action import ActionBase

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.preflight import (
    NONCE_ARGUMENT_SPEC,
    write_shared_nonces,
)


class ActionModule(ActionBase):
    """Push mode's controller writes a few small files before the nodes' checks: as a module, that would be a
    Python started and an AnsiballZ payload unpacked for them on every job."""

    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        _, params = self.validate_argument_spec(argument_spec=NONCE_ARGUMENT_SPEC)
        if self._task.check_mode:
            return dict(result, changed=True, nonce_files=[entry["nonce_file"] for entry in params["shared_dirs"]])
        try:
            written = write_shared_nonces(params["nonce"], params["shared_dirs"], params["results_dir"])
        except (OSError, JobLayoutError) as exc:
            return dict(result, failed=True, msg=f"cannot write the preflight nonce: {exc}")
        return dict(result, changed=True, nonce_files=written)
