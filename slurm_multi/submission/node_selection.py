"""Choosing healthy nodes before submitting (`submit --preflight`).

The candidates are the usable nodes of the job's partition and reservation (its ``--nodelist`` when given), without
its ``--exclude``. Their settings are Ansible's answer (playbooks/node_selection_settings.yml, run with the job's
ansible.cfg, environment and extra vars and the candidates as its allocation), so an inventory's group_vars and
host_vars count as in the job's own preflight stage. One short ``srun`` per set of equal settings then runs
module_utils/node/preflight.py on each candidate (one JSON line per node back), after the submit host wrote a nonce
into the shared dirs. The job goes to the first healthy nodes (``--nodelist``) with the others in ``--exclude``; too
few healthy nodes raise SlurmMultiError naming every node left out and why. Neither the play nor the srun gets
``MAD_SECRETS_*``.
"""

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import resolve_cache_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import dir_trust as results_dir_trust
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import preflight as runtime_preflight
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    AllocationError,
    expand_nodelist,
)
from slurm_multi.errors import SlurmMultiError
from slurm_multi.spec import JobSpec
from slurm_multi.submission import sbatch
from slurm_multi.submission.job_vars import VARS_FILE_NAME, write_job_vars
from slurm_multi.submission.retry import options_without
from slurm_multi.submission.sbatch import SbatchError, SlurmOptions, find_ansible_playbook
from slurm_multi.submission.secrets import without_secrets

# The play that resolves each candidate's settings (relative to the Ansible content's root).
SETTINGS_PLAYBOOK = Path("playbooks", "node_selection_settings.yml")
# How long that play may take: it reaches no node, so only a hung inventory source or vars plugin takes long.
SETTINGS_TIMEOUT_SECONDS = 120
# How long the preflight srun may wait for its allocation of the candidates (busy nodes), and run in all.
ALLOCATION_WAIT_SECONDS = 60
SRUN_TIMEOUT_SECONDS = 180


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


def resolved_settings(spec: JobSpec, root: Path, nodes: list[str]) -> dict[str, dict[str, Any]]:
    """Each node's preflight settings as Ansible resolves them for this job, by their group_vars names
    (playbooks/node_selection_settings.yml lists them); a node the inventory does not list is absent."""
    workdir = Path(tempfile.mkdtemp(prefix="slurm-multi-settings-"))
    try:
        vars_file, answer = workdir / VARS_FILE_NAME, workdir / "settings.json"
        write_job_vars(vars_file, spec.job_vars())
        # Ansible's default forks: its tasks run on this host, and one fork per node is no faster.
        answer_var = json.dumps({"node_selection_answer": str(answer)})
        argv = [str(find_ansible_playbook()), str(root / SETTINGS_PLAYBOOK), "-e", f"@{vars_file}", "-e", answer_var]
        # As the job's script runs its playbook (this environment, ansible.cfg), with the candidates as the
        # allocation; the count too, which an allocation this runs in would contradict.
        env = dict(
            without_secrets(os.environ),
            ANSIBLE_CONFIG=str(root / "ansible.cfg"),
            SLURM_JOB_NODELIST=",".join(nodes),
            SLURM_JOB_NUM_NODES=str(len(nodes)),
        )
        try:
            ran = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SETTINGS_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            raise SlurmMultiError(
                f"preflight: Ansible gave no answer for the job's settings in {SETTINGS_TIMEOUT_SECONDS} s "
                f"({SETTINGS_PLAYBOOK}): a hung inventory source? Nothing was submitted"
            ) from None
        if ran.returncode != 0:
            output = (ran.stdout + ran.stderr).splitlines()
            said = [line for line in output if line.startswith(("[ERROR]", "ERROR!", "fatal:", "Origin: /"))]
            raise SlurmMultiError(
                f"preflight: Ansible could not resolve the job's settings ({SETTINGS_PLAYBOOK} exited "
                f"{ran.returncode}), nor would the job: fix what it says. Nothing was submitted.\n"
                + "\n".join(said[:12] or output[-8:])
            )
        if not answer.exists():  # an inventory without hosts: the play had none to run on
            return {}
        return {values["node"]: values for values in json.loads(answer.read_text())}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _shared_dirs(values: Mapping[str, Any]) -> dict[str, Path]:
    """The dirs a node must share with this host, by setting: its results dir, and its image cache dir once made
    (the first publish makes it; registry mode has none)."""
    dirs = {"results_dir": Path(values["results_dir"])}
    if not values["registry"]:
        # The nodes' rule (MAD_DOCKER_BUILDS over the setting, %u the user): the job's environment is this one's.
        cache = Path(resolve_cache_dir(str(values["image_cache_dir"])))
        if cache.is_dir():
            dirs["image_cache_dir"] = cache
    return dirs


def _check_settings(values: Mapping[str, Any], nonce: str, tag: str) -> dict[str, Any]:
    """What module_utils/node/preflight.py checks a node with, from the node's resolved settings."""
    settings = {
        # --preflight asks for the checks: a job that turned its preflight stage off ([]) is checked in full here.
        "checks": values["preflight_checks"] or list(preflight.CHECKS),
        "shared_dirs": [
            {"name": name, "path": str(path), "nonce_file": str(path / tag)}
            for name, path in _shared_dirs(values).items()
        ],
        "nonce": nonce,
        # Ansible's answer: the role's argument spec requires both as numbers, its default the one home's.
        "disk_headroom_gb": values["preflight_disk_headroom_gb"],
        "max_clock_skew": values["preflight_max_clock_skew"],
        "gpu_vendor": str(values["gpu_vendor"] or ""),
        # One clock for every candidate, the shared filesystem's: srun's delay before a check starts is no skew.
        "clock_dir": str(values["results_dir"]),
        "container_runtime": values.get("container_runtime") or "docker",
        "charliecloud_unpack_dir": values.get("charliecloud_unpack_dir") or "/var/tmp/slurm-multi-%u/images",
        "image_cache_dir": str(values["image_cache_dir"]),
    }
    if values["preflight_image_size_gb"]:
        settings["image_bytes"] = int(float(values["preflight_image_size_gb"]) * 1e9)
    if values["preflight_n_gpus"] not in (None, ""):
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


def preflight_srun_argv(slurm: SlurmOptions, nodes: list[str], python: str, settings: dict) -> list:
    """The one srun that checks ``nodes``: one task each, in the job's partition, reservation, account and QOS;
    each runs the preflight module with ``python`` (the content's collections/ on PYTHONPATH: `select_nodes`)."""
    argv = [
        "srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}", f"--job-name={slurm.job_name}-preflight",
        f"--immediate={ALLOCATION_WAIT_SECONDS}", "--kill-on-bad-exit=0", "--time=5",
    ]  # fmt: skip
    for name in ("partition", "reservation", "account", "qos", "gpus_per_node"):
        value = getattr(slurm, name)
        if value:
            argv.append(f"--{name.replace('_', '-')}={value}")
    # The runtime's preflight: node/preflight.py's checks, the docker check the job's runtime's own.
    return argv + [python, "-m", runtime_preflight.__name__, "--json", json.dumps(settings, sort_keys=True)]


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
    try:
        results_dir_trust.check_results_dir(str(spec.results_dir), create=True)
    except JobLayoutError as exc:
        raise SlurmMultiError(str(exc)) from None
    started = time.monotonic()
    resolved = resolved_settings(spec, root, candidates)
    say(f"preflight: the candidates' settings resolved by Ansible in {time.monotonic() - started:.1f} s")
    nonce = secrets.token_hex(12)
    tag = f".preflight-select-{nonce[:8]}.nonce"
    # One srun for the nodes of the same settings: all of them, unless an inventory group or host sets its own.
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for node in candidates:
        if node in resolved:
            settings = _check_settings(resolved[node], nonce, tag)
            groups.setdefault(json.dumps(settings, sort_keys=True), (settings, []))[1].append(node)
    nonce_files = {Path(entry["nonce_file"]) for settings, _ in groups.values() for entry in settings["shared_dirs"]}
    checked = {node: [_unlisted(node)] for node in candidates if node not in resolved}
    say(f"preflight: checking {', '.join(candidates)} (one srun task each)")
    try:
        for path in nonce_files:
            preflight.write_nonce(str(path), nonce)
        for settings, nodes in groups.values():
            checked.update(_check_nodes(slurm, nodes, root, settings))
    finally:
        for path in nonce_files:
            path.unlink(missing_ok=True)
    checked = {node: checked[node] for node in candidates}
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


def _check_nodes(
    slurm: SlurmOptions, nodes: list[str], root: Path, settings: dict[str, Any]
) -> dict[str, list[dict[str, str]]]:
    """Each node's problems, from one srun that checks ``nodes`` with ``settings``."""
    argv = preflight_srun_argv(slurm, nodes, sys.executable, settings)
    env = dict(without_secrets(os.environ), PYTHONPATH=str(root / "collections"))
    try:
        answer = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SRUN_TIMEOUT_SECONDS)
    except FileNotFoundError:
        raise SlurmMultiError("preflight: `srun` is not on PATH: run this on a SLURM login node") from None
    except subprocess.TimeoutExpired:
        raise SlurmMultiError(
            f"preflight: the check of {', '.join(nodes)} took more than {SRUN_TIMEOUT_SECONDS} s (busy nodes "
            "waiting for the allocation, or a node that hangs): nothing was submitted"
        ) from None
    failure = " ".join(answer.stderr.strip().splitlines()[-2:]) if answer.returncode not in (0, 1) else ""
    return parse_preflight_output(answer.stdout, nodes, failure)


def _unlisted(node: str) -> dict[str, str]:
    return preflight.problem(
        "preflight",
        f"Ansible's inventory lists no host {node}, so the job's play would leave it out",
        "keep the slurm_allocation source (inventory/slurm.yml) in the inventory (ANSIBLE_INVENTORY, ansible.cfg)",
    )


def _describe(problems: list[Mapping[str, str]]) -> str:
    return "; ".join(
        f"{item.get('check')}: {item.get('problem')}" + (f" (fix: {item['fix']})" if item.get("fix") else "")
        for item in problems
    )
