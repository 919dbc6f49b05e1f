"""docs/settings.md: the reference of every setting, generated from their one home (module_utils/job/defaults.py).

    python -m slurm_multi.settings_doc > docs/settings.md

tests/unit/module_utils/job/test_pipeline_defaults.py fails while the committed file differs from what this prints.
"""

import json

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import COMPUTED, SECTIONS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import PER_JOB_SETTINGS

INTRO = """\
# Settings

Every setting a job takes, its default, the values it takes and where else it can be set. Generated from the
settings' one home, module_utils/job/defaults.py, by `python -m slurm_multi.settings_doc > docs/settings.md`; a test
fails while this page is out of date.

## How to set one

From lowest to highest precedence:

1. The built-in default (below; group_vars/all.yml reads each from the one home).
2. The site's file, `/etc/slurm-multi/site.yml` (`$SLURM_MULTI_SITE_CONFIG` names another): its `settings:`
   mapping, defaults for every job of the site.
3. Your own file, `~/.config/slurm-multi/settings.yml` (`$SLURM_MULTI_SETTINGS` names another): a mapping of
   setting to value.
4. The setting's environment variable, where it has one.
5. Its `slurm-multi submit`/`run` flag, where it has one.
6. `-e NAME=VALUE` on `slurm-multi submit`/`run` (or on a raw `ansible-playbook`), repeatable; `-e @FILE` reads a
   YAML or JSON file of them. VALUE is read as YAML, so `-e barrier_timeout=900` is a number.
   `-e "additional_docker_run_options=--ulimit memlock=-1 --shm-size 8g"` takes the words up to the next
   setting's name as its one string of options.

Every value is checked against its row below (its type as Ansible converts it, its choices, its range) before
anything is queued: `slurm-multi submit`, `run` and `settings` refuse a value the row does not take, naming the
setting, the source that gave it, what it takes and an example, and exit 2; the job makes the same check again
(its first task) for what a raw `ansible-playbook -e` or an inventory of your own gives.

The two files reach the playbook through the inventory (plugins/inventory/slurm_allocation.py gives their settings
to every node as host vars), so a raw `ansible-playbook playbooks/run_multi.yml` honours them too. An unknown name
in either file or in `-e` is refused, naming the closest one. A file that `$SLURM_MULTI_SITE_CONFIG` or
`$SLURM_MULTI_SETTINGS` names must exist: a missing one is refused, naming the variable (an empty file gives no
settings). {per_job} name what one job runs: the files refuse
them (give them with the job). Secrets are never settings: export them as `MAD_SECRETS_*` (docs/secrets.md).
Whoever may write a file decides what every job gets (the site file: every user's node addresses), so each must be
yours or root's and writable by its owner alone: one another user owns, or that its group or every user may write,
is refused, naming the file and the fix (`chmod go-w FILE`, `chown root FILE`).

    # /etc/slurm-multi/site.yml
    node_addresses:            # node name -> the address rank 0 is reached at (master_addr)
      gpu001: 10.0.0.1
    settings:
      image_cache_dir: /shared/slurm-multi/image-cache-%u
      preflight_max_clock_skew: 5

    # ~/.config/slurm-multi/settings.yml
    results_dir: /shared/me/results
    barrier_timeout: 900
"""


TABLE_HEAD = "| setting | default | takes | flag | environment | in the files | meaning |\n" + "|---" * 7 + "|\n"


def takes(setting) -> str:
    """The values a setting takes, as its row says (`setting_problems` refuses the others)."""
    kind = f"list of {setting.elements}" if setting.kind == "list" and setting.elements else setting.kind
    words = [kind]
    if setting.choices is not None:
        words.append(("each one of " if setting.kind == "list" else "one of ") + ", ".join(setting.choices))
    if setting.minimum is not None and setting.maximum is not None:
        words.append(f"{setting.minimum:g} to {setting.maximum:g}")
    elif setting.minimum is not None:
        words.append(f"{setting.minimum:g} or more")
    if setting.rule == "range":
        words.append("[LOW, HIGH], LOW <= HIGH")
    if setting.rule == "shell_words":
        words.append("an argv list, or one string split as a shell splits it")
    return ": ".join(words[:1] + ["; ".join(words[1:])]) if len(words) > 1 else kind


def settings_reference() -> str:
    """The whole of docs/settings.md."""
    parts = [INTRO.format(per_job=", ".join(f"`{name}`" for name in PER_JOB_SETTINGS))]
    for title, settings in SECTIONS:
        parts.append(f"\n## {title}\n\n{TABLE_HEAD}")
        for setting in settings:
            flag = f"`{setting.flag}`" if setting.flag else ""
            env = f"`{setting.env}`" if setting.env else ""
            files = "no: one job's" if setting.name in PER_JOB_SETTINGS else "yes"
            default = setting.computed if setting.default is COMPUTED else f"`{json.dumps(setting.default)}`"
            row = [f"`{setting.name}`", default, takes(setting), flag, env, files, setting.doc]
            parts.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(settings_reference(), end="")
