"""Each node's container command as `submit --dry-run` shows it: the run module's own plan (`plan_model_run`, on the
login node), from the job's config as the running stage passes it; what only a node knows stays a ``<...>`` mark."""

import os
import tempfile
from pathlib import Path
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import runtimes
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_manifest,
    load_model_cards,
    select_model_cards,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import deep_merge, restore_context
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import effective_settings
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import model_distributed
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import ModelRun, plan_model_run
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_scripts import scripts_source
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    AllocationError,
    expand_nodelist,
    explicit_master_addr,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.errors import SlurmMultiError
from slurm_multi.spec import JobSpec, content_root
from slurm_multi.submission.sbatch import SlurmOptions
from slurm_multi.submission.secrets import user_secrets, write_secrets_file

# Stand-ins that pass the job layout's rules while the plan is made, shown as the marks after it.
_JOB_ID = "slurmmultijobid"
_NODE = "slurmmultinode{}"
# Put in after the lines are quoted: no space, no quote in them.
JOB_ID_MARK = "<job-id>"
IMAGE_MARK = "<image ID, from the build of rank 0>"
IMAGE_NAME_MARK = "<image name>"
MASTER_ADDR_MARK = "<address of rank 0, resolved on rank 0>"
MASTER_PORT_MARK = "<MASTER_PORT, else a port derived from the job ID>"


def container_commands(spec: JobSpec, slurm: SlurmOptions) -> list[tuple[str, list[str]]]:
    """``[(node, the lines of its container's command)]`` in rank order, for the job's first model: the nodes of
    ``--nodelist`` when it names them all, else ``<node N>``."""
    names = _node_names(slurm)
    settings = {name: value for name, value, _ in effective_settings(spec.extra_vars)}
    # The job reads group_vars' default when none is given: the checkout's own model zoo.
    models_file = spec.models_file or content_root(None) / "models" / "models.json"
    card = _first_card(spec, models_file)
    zoo = models_file.parent
    context = _run_context(spec, settings)
    addresses = dict(settings.get("node_addresses") or {})
    master_addr = explicit_master_addr(os.environ, addresses, names[0]) or MASTER_ADDR_MARK
    try:
        _, script = scripts_source(str(zoo / str(card.get("scripts", ""))))
    except UserError as err:
        return [(node, [f"# the container's command cannot be shown: {err}"]) for node in names]
    secrets = user_secrets(os.environ)
    shown = []
    with tempfile.TemporaryDirectory(prefix="slurm-multi-dry-run-") as private:
        secrets_file = str(write_secrets_file(Path(private), secrets)) if secrets else None
        runtime = runtimes.by_name(str(settings.get("container_runtime") or "docker"))
        for rank, node in enumerate(names):
            run = ModelRun(
                job_id=_JOB_ID,
                rank=rank,
                nnodes=len(names),
                node=node,
                model=str(card["name"]),
                image=IMAGE_MARK,
                model_dir=os.path.join(job_layout.node_dir(str(spec.results_dir), _JOB_ID, 0, node), "workspace"),
                script=script,
                model_args=card.get("args") or "",
                results_dir=str(spec.results_dir),
                master_addr=master_addr,
                master_port=os.environ.get("MASTER_PORT") or MASTER_PORT_MARK,
                docker_env_vars=context.get("docker_env_vars") or {},
                docker_mounts=context.get("docker_mounts") or {},
                additional_docker_run_options=settings.get("additional_docker_run_options") or "",
                guest_os=str(context.get("guest_os") or "UBUNTU"),
                secrets_file=secrets_file,
                multiple_results=card.get("multiple_results") or None,
                distributed=model_distributed(card, spec.additional_context, len(names)).as_dict(),
                allocation_nodes=names,
                node_addresses=addresses,
                provenance={"docker_image": IMAGE_NAME_MARK},
                tools=context.get("tools") or [],
                tools_file=settings.get("tools_file") or str(zoo / "scripts" / "common" / "tools.json"),
                on_login_node=True,
            )
            try:
                lines = plan_model_run(run, runtime.plan)["command_lines"]
            except UserError as err:
                # The job's own checks refuse it where they must; the dry run still shows the rest.
                lines = [f"# the container's command cannot be shown: {err}"]
            shown.append((_shown(node, names), [_shown(line, names) for line in lines]))
    return shown


def _node_names(slurm: SlurmOptions) -> list[str]:
    if slurm.nodelist:
        try:
            nodes = expand_nodelist(slurm.nodelist, "--nodelist")
        except AllocationError as err:
            raise SlurmMultiError(f"--nodelist {slurm.nodelist!r}: {err}") from None
        if len(nodes) == slurm.nodes:
            return nodes
    return [_NODE.format(rank) for rank in range(slurm.nodes)]


def _shown(text: str, names: list[str]) -> str:
    text = text.replace(_JOB_ID, JOB_ID_MARK)
    for rank in reversed(range(len(names))):  # rank 10 before rank 1, which its stand-in begins with
        text = text.replace(_NODE.format(rank), f"<node-of-rank-{rank}>")
    return text


def _first_card(spec: JobSpec, models_file: Path) -> dict[str, Any]:
    if spec.sweep:
        return dict(spec.sweep[0])
    cards = select_model_cards(load_model_cards(str(models_file)), list(spec.tags))
    if not cards:
        raise SlurmMultiError(f"--tags {','.join(spec.tags)} selects no model of {models_file}")
    return dict(cards[0])


def _run_context(spec: JobSpec, settings: dict[str, Any]) -> dict[str, Any]:
    """The run context as the preparation stage restores it (plugins/filter/run_context.py), before any node's own."""
    manifest = load_manifest(str(spec.manifest_path))["context"] if spec.manifest_path else {}
    restored = restore_context(manifest or {}, dict(spec.additional_context), os.environ, defer_secrets=True)
    return deep_merge(dict(settings.get("default_context") or {}), restored)
