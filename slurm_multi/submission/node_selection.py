"""Choosing healthy nodes before submitting (`submit --preflight`).

The candidates are the nodes the job could get: the usable nodes of its partition and reservation (sinfo; its
``--nodelist`` when given), without its ``--exclude``. One short ``srun`` (one task per candidate) runs the
preflight checks on each of them, through module_utils/node/preflight.py as a plain script (``--json '<settings>'``,
one JSON line per node back: ``{"node", "problems"}``), with the settings the job's preflight stage uses
(group_vars' ``preflight_*``, the job's own vars over them). The submit host writes a nonce into the results dir
and the image cache dir first, so a node that does not share them shows it. The job is then submitted on the
first healthy nodes (``--nodelist``) with the others in ``--exclude``; its job name, partition, reservation,
account and QOS stay. Too few healthy nodes: SlurmMultiError naming every node left out and why, nothing submitted.

Nothing secret is in the settings (paths, counts, check names), and the srun gets no ``MAD_SECRETS_*``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from ansible.module_utils.image.cache.entries import resolve_cache_dir
from ansible.module_utils.job import defaults
from ansible.module_utils.job.layout import JobLayoutError
from ansible.module_utils.node import preflight
from ansible.module_utils.results import dir_trust as results_dir_trust
from ansible.module_utils.slurm.allocation import AllocationError, expand_nodelist
from slurm_multi.errors import SlurmMultiError
from slurm_multi.spec import JobSpec
from slurm_multi.submission import sbatch
from slurm_multi.submission.retry import options_without
from slurm_multi.submission.sbatch import SbatchError, SlurmOptions
from slurm_multi.submission.secrets import without_secrets

# The checks each candidate runs, as a plain script (relative to the Ansible content's root).
PREFLIGHT_SCRIPT = Path("module_utils", "node", "preflight.py")
# How long the preflight srun may wait for its allocation of the candidates (busy nodes), and run in all.
ALLOCATION_WAIT_SECONDS = 60
SRUN_TIMEOUT_SECONDS = 180
# group_vars settings the node selection reads (literal values only: a Jinja default is not evaluated here).
_SETTINGS = (
    "preflight_checks",
    "preflight_disk_headroom_gb",
    "preflight_image_size_gb",
    "preflight_n_gpus",
    "preflight_max_clock_skew",
)


@dataclass(frozen=True)
class NodeSelection:
    """What the preflight of the candidates found: each node's problems, the nodes chosen and the options the job
    is submitted with (healthy nodes in ``--nodelist``, the others in ``--exclude``)."""

    checked: dict[str, list[dict[str, str]]]
    chosen: list[str]
    slurm: SlurmOptions
    seconds: float

    @property
    def left_out(self) -> dict[str, list[dict[str, str]]]:
        """The candidates with problems."""
        return {node: problems for node, problems in self.checked.items() if problems}

    def as_record(self) -> dict[str, Any]:
        """The selection as the job's record keeps it (``node_selection``)."""
        return {"checked": self.checked, "chosen": self.chosen, "left_out": sorted(self.left_out)}


def _group_vars(root: Path) -> dict:
    """group_vars/all.yml's settings, as written (a Jinja value is not evaluated here)."""
    try:
        return yaml.safe_load((root / "group_vars" / "all.yml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _number(values: dict, name: str):
    """A numeric setting's value, else its one default (module_utils/job/defaults.py): 0 is a value, not a gap."""
    value = values.get(name)
    return defaults.SETTING_DEFAULTS[name] if value in (None, "") else value


def _settings(spec: JobSpec, root: Path, shared_dirs: list[dict[str, str]], nonce: str) -> dict:
    given = {**_group_vars(root), **spec.job_vars()}
    values = {name: given.get(name) for name in _SETTINGS if not str(given.get(name, "")).startswith("{{")}
    settings = {
        "checks": values.get("preflight_checks") or list(preflight.CHECKS),
        "shared_dirs": shared_dirs,
        "nonce": nonce,
        "disk_headroom_gb": _number(values, "preflight_disk_headroom_gb"),
        "max_clock_skew": _number(values, "preflight_max_clock_skew"),
        "gpu_vendor": str(spec.additional_context.get("gpu_vendor") or ""),
        # One clock for every candidate, the shared filesystem's: srun's delay before a check starts is no skew.
        "clock_dir": str(spec.results_dir),
    }
    if values.get("preflight_image_size_gb"):
        settings["image_bytes"] = int(float(values["preflight_image_size_gb"]) * 1e9)
    if values.get("preflight_n_gpus") not in (None, ""):
        settings["card_n_gpus"] = values["preflight_n_gpus"]
    return settings


def candidate_nodes(slurm: SlurmOptions) -> list[str]:
    """The nodes the job could get: usable ones of its partition and reservation (its node list's when given),
    without its excluded ones."""
    try:
        usable = sbatch.usable_nodes(slurm.partition, slurm.reservation)
        listed = expand_nodelist(slurm.nodelist, "--nodelist") if slurm.nodelist else None
        excluded = set(expand_nodelist(slurm.exclude, "--exclude")) if slurm.exclude else set()
    except (SbatchError, AllocationError) as exc:
        raise SlurmMultiError(f"preflight: cannot list the candidate nodes: {exc}") from None
    return [node for node in usable if node not in excluded and (listed is None or node in listed)]


def preflight_srun_argv(slurm: SlurmOptions, nodes: list[str], python: str, script: Path, settings: dict) -> list:
    """The one srun that checks ``nodes``: one task each, in the job's partition, reservation, account and QOS."""
    argv = [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        f"--job-name={slurm.job_name}-preflight",
        f"--immediate={ALLOCATION_WAIT_SECONDS}",
        "--kill-on-bad-exit=0",
        "--time=5",
    ]
    for name in ("partition", "reservation", "account", "qos", "gpus_per_node"):
        value = getattr(slurm, name)
        if value:
            argv.append(f"--{name.replace('_', '-')}={value}")
    return argv + [python, str(script), "--json", json.dumps(settings, sort_keys=True)]


def parse_preflight_output(stdout: str, nodes: list[str], failure: str) -> dict[str, list[dict[str, str]]]:
    """Each node's problems from the srun's output (one JSON line per node); a node that printed none gets one
    problem saying so, with ``failure`` (srun's own words)."""
    found: dict[str, list[dict[str, str]]] = {}
    for line in stdout.splitlines():
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and result.get("node") in nodes and isinstance(result.get("problems"), list):
            found[result["node"]] = result["problems"]
    for node in nodes:
        if node not in found:
            found[node] = [
                preflight.problem(
                    "preflight",
                    f"no answer from the preflight check on {node}" + (f" ({failure})" if failure else ""),
                    f"check that {node} is up and runs SLURM job steps (srun -w {node} true)",
                )
            ]
    return {node: found[node] for node in nodes}


def select_nodes(
    spec: JobSpec, slurm: SlurmOptions, root: Path, *, on_progress: Callable[[str], None] | None = None
) -> NodeSelection:
    """Check the candidate nodes and choose the job's nodes (module docstring); SlurmMultiError when too few are
    healthy (nothing is submitted then)."""
    say = on_progress or (lambda _line: None)
    candidates = candidate_nodes(slurm)
    if len(candidates) < slurm.nodes:
        raise SlurmMultiError(
            f"preflight: the job needs {slurm.nodes} nodes but only {len(candidates)} are usable candidates "
            f"({', '.join(candidates) or 'none'}); nothing was submitted"
        )
    nonce = secrets.token_hex(12)
    tag = f".preflight-select-{nonce[:8]}.nonce"
    try:
        results_dir_trust.check_results_dir(str(spec.results_dir), create=True)
    except JobLayoutError as exc:
        raise SlurmMultiError(str(exc)) from None
    shared_dirs = {"results_dir": spec.results_dir}
    cache_dir = _image_cache_dir(spec, root)
    if cache_dir and cache_dir.is_dir():  # a cache dir not made yet is made by the first publish
        shared_dirs["image_cache_dir"] = cache_dir
    nonce_files = {name: path / tag for name, path in shared_dirs.items()}
    settings = _settings(
        spec,
        root,
        [{"name": name, "path": str(shared_dirs[name]), "nonce_file": str(path)} for name, path in nonce_files.items()],
        nonce,
    )
    argv = preflight_srun_argv(slurm, candidates, sys.executable, root / PREFLIGHT_SCRIPT, settings)
    say(f"preflight: checking {', '.join(candidates)} (one srun task each)")
    started = time.monotonic()
    try:
        for path in nonce_files.values():
            preflight.write_nonce(str(path), nonce)
        answer = subprocess.run(
            argv, env=without_secrets(os.environ), capture_output=True, text=True, timeout=SRUN_TIMEOUT_SECONDS
        )
        failure = " ".join(answer.stderr.strip().splitlines()[-2:]) if answer.returncode not in (0, 1) else ""
    except FileNotFoundError:
        raise SlurmMultiError("preflight: `srun` is not on PATH: run this on a SLURM login node") from None
    except subprocess.TimeoutExpired:
        raise SlurmMultiError(
            f"preflight: the check of {', '.join(candidates)} took more than {SRUN_TIMEOUT_SECONDS} s (busy nodes "
            "waiting for the allocation, or a node that hangs): nothing was submitted"
        ) from None
    finally:
        for path in nonce_files.values():
            path.unlink(missing_ok=True)
    checked = parse_preflight_output(answer.stdout, candidates, failure)
    seconds = time.monotonic() - started
    healthy = [node for node in candidates if not checked[node]]
    for node, problems in checked.items():
        if problems:
            say(f"preflight: leaving out {node}: {_describe(problems)}")
    if len(healthy) < slurm.nodes:
        left_out = "; ".join(f"{node}: {_describe(problems)}" for node, problems in checked.items() if problems)
        raise SlurmMultiError(
            f"preflight: only {len(healthy)} of the {len(candidates)} candidate nodes are healthy "
            f"({', '.join(healthy) or 'none'}), the job needs {slurm.nodes}. Left out: {left_out}. "
            "Nothing was submitted: fix those nodes, or ask for fewer nodes"
        )
    chosen = healthy[: slurm.nodes]
    bad = [node for node in candidates if checked[node]]
    options = replace(options_without(slurm, bad), nodelist=",".join(chosen))
    say(f"preflight: {len(healthy)} healthy node(s) in {seconds:.1f} s; submitting on {', '.join(chosen)}")
    return NodeSelection(checked, chosen, options, seconds)


def _describe(problems: list[Mapping[str, str]]) -> str:
    return "; ".join(
        f"{item.get('check')}: {item.get('problem')}" + (f" (fix: {item['fix']})" if item.get("fix") else "")
        for item in problems
    )


def _image_cache_dir(spec: JobSpec, root: Path) -> Path | None:
    """The job's image cache dir (None in registry mode, which has none)."""
    if spec.registry:
        return None
    value = str(spec.extra_vars.get("image_cache_dir") or _group_vars(root).get("image_cache_dir") or "")
    if not value or value.startswith("{{"):  # group_vars' own default, as its pipeline_default filter gives it
        value = defaults.IMAGE_CACHE_DIR
    # The nodes' rule (MAD_DOCKER_BUILDS over the setting, %u the user): the job's environment is this one's.
    return Path(resolve_cache_dir(value))
