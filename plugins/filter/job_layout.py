"""Filter: paths of a job's results layout, for tasks that cannot ask a module (logic in module_utils/job_layout)."""

from slurm_multi.paths import use_project_module_utils

use_project_module_utils()  # controller-side plugins import the project's module_utils under the modules' names
from ansible.errors import AnsibleFilterError  # noqa: E402
from ansible.module_utils import job_layout  # noqa: E402


def node_results_dir(results_dir, job_id, attempt, node):
    """``<results_dir>/<job_id>/attempt-<attempt>/nodes/<node>``: a node's results for one attempt of the job."""
    try:
        return job_layout.node_dir(str(results_dir), str(job_id), attempt, str(node))
    except job_layout.JobLayoutError as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self):
        return {"node_results_dir": node_results_dir}
