"""The one seam between the Ansible content and the project's module_utils on the controller.

The modules reach module_utils/ through ansible.cfg's `module_utils` setting: AnsiballZ ships what they import, as
``ansible.module_utils.<name>``. The controller-side plugins (filters, the inventory, the srun connection) run in
Ansible's own process, where that setting does not apply. Importing this file makes the same names resolve there,
to the same files:

    from ansible_collections.slurm_multi.pipeline.plugins.module_utils import project_module_utils  # noqa: F401
    from ansible.module_utils.job.layout import attempt_dir

Ansible finds this collection through ansible.cfg's `collections_path`; tests put collections/ on sys.path. The
checkout (or the installed wheel's ansible_content) holds it six folders up, beside module_utils/. galaxy.yml
gives the collection its name and version. The slurm_multi
package has its own side of the seam (slurm_multi.paths.use_project_module_utils); no plugin imports the package.
"""

import os
from pathlib import Path

import ansible.module_utils

# collections/ansible_collections/slurm_multi/pipeline/plugins/module_utils/<this file>: the checkout is parents[6].
MODULE_UTILS = str(Path(os.path.abspath(__file__)).parents[6] / "module_utils")
if MODULE_UTILS not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(MODULE_UTILS)
