"""The preflight checks: is this node fit to take part in a run (docs/nodes.md)? Every check runs; each problem is
``{"check", "problem", "fix"}``. Runnable without Ansible (node selection runs it through ``srun``):
``python3 -m ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.preflight --json '<settings>'``."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import docker_api
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import (
    DockerError,
    image_inspect,
    run_docker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.devices import allocated_gpu_indices
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.facts import VENDOR_NONE, detect_gpus
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import ImageCacheError, entry_key
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import (
    PREFLIGHT_CHECKS,
    SETTING_DEFAULTS,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.dir_trust import make_job_dirs, user_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import node_local_tmp_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

CHECKS = PREFLIGHT_CHECKS  # the settings table names them
DOCKER_TIMEOUT = 15.0
NONCE_FILE = "preflight.nonce"
# The image cache is shared by jobs: each attempt's nonce file has its own name in this subdir.
NONCE_DIR = ".preflight"
# The nodes' results in the attempt dir (what the record's preflight section is made of).
RESULTS_DIR = "preflight"
GB = 1e9
# Devices a container holding GPUs has (AMD: the KFD and DRM render nodes; NVIDIA: /dev/nvidia*).
_GPU_DEVICE_PREFIXES = ("/dev/kfd", "/dev/dri", "/dev/nvidia")


def problem(check: str, text: str, fix: str) -> Dict[str, str]:
    """One problem of a check."""
    return {"check": check, "problem": text, "fix": fix}


# --- docker and disk -----------------------------------------------------------------------------------------------


def docker_root_dir(node: str, timeout: float = DOCKER_TIMEOUT):
    """(Docker's data root, None) when the daemon answers, else (None, the problem)."""
    root = docker_api.server_info("DockerRootDir", timeout=timeout)
    if isinstance(root, str) and root:
        return root, None
    try:
        result = run_docker(["info", "--format", "{{.DockerRootDir}}"], timeout=timeout)
    except DockerError as exc:
        cause = docker_cause(exc.stderr_tail or exc.problem or "")
        if "permission denied" in cause.lower():
            user = user_name(os.geteuid())
            fix = (
                f"the Docker daemon on {node} does not let {user} in: add {user} to the docker group (the socket's "
                "group; then log in again), run rootless Docker (DOCKER_HOST=unix://$XDG_RUNTIME_DIR/docker.sock), "
                "or run without a daemon: container_runtime: charliecloud"
            )
            # The fix in the problem itself: it is what the job's verdict and the CLI show.
            return None, problem("docker", f"Docker refuses {user} on {node} ({cause}): {fix}", fix)
        return None, problem(
            "docker",
            f"Docker daemon not answering on {node}" + (f" ({cause})" if cause else ""),
            f"start dockerd on {node}, or fix DOCKER_HOST / the socket's permissions for this user",
        )
    return result.stdout.strip(), None


# Docker's own words for why it could not reach the daemon, most telling first.
_DOCKER_CAUSES = ("permission denied", "cannot connect to the docker daemon", "error during connect", "no such file")


def docker_cause(stderr: str) -> str:
    """The line of the docker CLI's ``stderr`` that says why the daemon did not answer: `docker info --format` ends
    with a template error of its own (``<.DockerRootDir>: ... nil pointer``) that hides Docker's real one."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for needle in _DOCKER_CAUSES:
        for line in lines:
            if needle in line.lower():
                return line
    told = [line for line in lines if not line.startswith("template:")]
    return (told or lines or [""])[-1]


def disk_problem(
    node: str, root: str, free_bytes: int, image_bytes: Optional[int], headroom_gb: float
) -> Optional[Dict[str, str]]:
    """The disk check's verdict on ``free_bytes`` under Docker's data root ``root``."""
    needed = (image_bytes or 0) + headroom_gb * GB
    if free_bytes >= needed:
        return None
    what = f"the image needs {image_bytes / GB:.1f} GB plus " if image_bytes else ""
    return problem(
        "disk",
        f"{free_bytes / GB:.1f} GB free under Docker's data root {root} on {node}; {what}"
        f"{headroom_gb:g} GB headroom ({needed / GB:.1f} GB in all)",
        f"free space on {node} (docker image prune, docker system df) or lower preflight_disk_headroom_gb",
    )


def known_image_bytes(image_ids: Sequence[str], cache_dir: Optional[str] = None) -> Optional[int]:
    """The images' size in all: each one's tar in the image cache when the cache holds it, else its size in this
    node's Docker; None when neither knows any of them (the job builds an image not made before)."""
    total, known = 0, False
    for image_id in image_ids or ():
        size = None
        try:
            size = os.path.getsize(os.path.join(cache_dir, entry_key(image_id) + ".tar")) if cache_dir else None
        except (OSError, ValueError, ImageCacheError):
            pass
        if not size:
            try:
                size = int((image_inspect(image_id) or {}).get("Size") or 0)
            except (DockerError, ValueError, TypeError):
                size = None
        if size:
            total, known = total + size, True
    return total if known else None


def free_bytes(path: str) -> int:
    """Bytes free for this user under ``path``."""
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


# --- shared directories --------------------------------------------------------------------------------------------


def _write_replacing(path: str, text: str) -> None:
    """Write ``path`` (its dir created 0755 if missing) by a temp file renamed over it: no reader sees half."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "w") as handle:
        handle.write(text)
    os.replace(temp, path)


def write_nonce(path: str, nonce: str) -> str:
    """Write the nonce file ``path``; the path."""
    _write_replacing(path, nonce)
    return path


# The options of the preflight_nonce module and of its action plugin (plugins/action/preflight_nonce.py), which
# the preflight role runs.
NONCE_ARGUMENT_SPEC = {
    "nonce": {"type": "str", "required": True},
    "shared_dirs": {"type": "list", "elements": "dict", "required": True},
    "results_dir": {"type": "path", "required": True},
}


def write_shared_nonces(nonce: str, shared_dirs: Sequence[Mapping[str, str]], results_dir: str) -> List[str]:
    """Write ``nonce`` into each shared dir's nonce file (push mode, on the controller), pruning ended jobs' nonce files
    in the image cache; the files written."""
    written = []
    for entry in shared_dirs:
        directory = os.path.dirname(entry["nonce_file"])
        if entry["name"] == "results_dir":
            make_job_dirs(directory, str(results_dir))
        else:
            prune_nonces(directory)
        written.append(write_nonce(entry["nonce_file"], str(nonce)))
    return written


def image_cache_nonce_file(image_cache_dir: str, job_id: str, attempt: Any) -> str:
    """The nonce file of a job's attempt in the image cache (one per attempt: jobs share the cache)."""
    return os.path.join(image_cache_dir, NONCE_DIR, f"{job_id}-{attempt}.nonce")


def prune_nonces(directory: str, max_age: float = 86400.0) -> None:
    """Remove nonce files older than ``max_age`` seconds from ``directory`` (ended jobs' leftovers)."""
    cutoff = time.time() - max_age
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            if name.endswith(".nonce") and os.lstat(path).st_mtime < cutoff:
                os.unlink(path)
        except OSError:
            pass


def read_nonce(path: str, wait: float = 0.0) -> Optional[str]:
    """The nonce file's content, waiting up to ``wait`` seconds for it to appear; None when it never does."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(path) as handle:
                return handle.read()
        except OSError:
            if time.monotonic() >= deadline:
                return None
        time.sleep(0.2)


def shared_dir_problems(node: str, dirs: Sequence[Mapping[str, str]], nonce: str, wait: float = 0.0) -> List[dict]:
    """Each of ``dirs`` ({"name": "results_dir", "path": the dir, "nonce_file": the nonce file in it}) whose nonce
    file this node does not read back with the content ``nonce``."""
    problems = []
    for entry in dirs:
        seen = read_nonce(entry["nonce_file"], wait)
        if seen == nonce:
            continue
        why = "is missing" if seen is None else "holds another nonce"
        problems.append(
            problem(
                "shared_dir",
                f"{entry['name']} {entry['path']} is not shared with {node}: the nonce file {entry['nonce_file']} "
                f"written for this job {why} there" + (f" (waited {wait:g} s)" if wait else ""),
                f"set {entry['name']} to a directory every node and the controller mount (a node-local /tmp is not)",
            )
        )
    return problems


# --- the nodes' results, and pull mode's exchange of them ------------------------------------------------------------


def result_path(attempt_dir: str, node: str) -> str:
    """Where a node's preflight result goes: ``<attempt_dir>/preflight/<node>.json``."""
    return os.path.join(attempt_dir, RESULTS_DIR, f"{node}.json")


def write_result(attempt_dir: str, result: Mapping[str, Any]) -> str:
    """Write this node's result (``node_preflight``'s) for the record; its path."""
    path = result_path(attempt_dir, result["node"])
    _write_replacing(path, json.dumps(result))
    return path


def read_results(attempt_dir: str, nodes: Sequence[str]) -> Dict[str, Optional[List[dict]]]:
    """``{node: its problems, None when it left no result}`` for ``nodes``."""
    results: Dict[str, Optional[List[dict]]] = {}
    for node in nodes:
        try:
            with open(result_path(attempt_dir, node)) as handle:
                problems = json.load(handle).get("problems")
            results[node] = list(problems) if isinstance(problems, list) else None
        except (OSError, ValueError, AttributeError):
            results[node] = None
    return results


def missing_result_problem(node: str, attempt_dir: str, wait: Optional[float] = None) -> Dict[str, str]:
    """The problem of a node that left no preflight result in the shared attempt dir."""
    waited = f" within {wait:g} s" if wait else ""
    return problem(
        "shared_dir",
        f"{node} left no preflight result in {os.path.join(attempt_dir, RESULTS_DIR)}{waited}: it does not see the "
        "shared results_dir there, or it stopped",
        f"check that results_dir is mounted on {node} (not node-local) and that {node} is up",
    )


def wait_for_results(attempt_dir: str, nodes: Sequence[str], wait: float) -> Dict[str, List[dict]]:
    """Pull mode's exchange: wait up to ``wait`` seconds for every node's result; ``{node: problems}`` of the nodes
    with problems, a node that left none within the bound counting as one problem."""
    deadline = time.monotonic() + wait
    while True:
        results = read_results(attempt_dir, nodes)
        if all(problems is not None for problems in results.values()) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return {
        node: problems if problems is not None else [missing_result_problem(node, attempt_dir, wait)]
        for node, problems in results.items()
        if problems is None or problems
    }


def record_section(
    attempt_dir: str, nodes: Sequence[str], statuses: Mapping[str, Optional[Mapping[str, Any]]]
) -> Optional[Dict[str, List[dict]]]:
    """The record's ``preflight`` section, ``{node: [problems]}`` for every node (empty: it passed); None when the
    stage did not run. A node's result file wins; else the problems its status.json carries (the rescue writes them
    on the controller, so a node whose results dir is not shared is still heard in push mode); else, once any node
    left a result, the missing node's own problem."""
    found = read_results(attempt_dir, nodes)
    # The stage ran when a node left its result, or a rescue recorded problems it found (every rescue writes the
    # field, empty when the node failed elsewhere: that alone says nothing).
    ran = any(problems is not None for problems in found.values()) or any(
        status and status.get("preflight") for status in statuses.values()
    )
    if not ran:
        return None
    for node, status in statuses.items():
        if found.get(node) is None and status and isinstance(status.get("preflight"), list):
            found[node] = list(status["preflight"])
    return {
        node: problems if problems is not None else [missing_result_problem(node, attempt_dir)]
        for node, problems in found.items()
    }


# --- scratch -------------------------------------------------------------------------------------------------------


def scratch_problem(node: str, path: str) -> Optional[Dict[str, str]]:
    """The node-local scratch dir for the env file: it must exist, be writable by this user and private (not
    writable by others, unless sticky like /tmp and /dev/shm)."""
    fix = f"create {path} on {node} (mode 1777 or 0700), or set TMPDIR to a private node-local directory"
    try:
        info = os.stat(path)
    except OSError as exc:
        return problem("scratch", f"the node-local scratch {path} does not exist on {node} ({exc.strerror})", fix)
    if not stat.S_ISDIR(info.st_mode):
        return problem("scratch", f"the node-local scratch {path} on {node} is not a directory", fix)
    if not os.access(path, os.W_OK | os.X_OK):
        return problem("scratch", f"the node-local scratch {path} on {node} is not writable by this user", fix)
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        return problem(
            "scratch",
            f"the node-local scratch {path} on {node} is writable by everyone without the sticky bit "
            f"(mode {stat.S_IMODE(info.st_mode):04o}): another user could replace the env file",
            f"chmod +t {path} on {node}, or set TMPDIR to a private directory",
        )
    return None


# --- GPUs ----------------------------------------------------------------------------------------------------------


def gpu_problems(
    node: str,
    vendor: str,
    count: int,
    allocated: Optional[Sequence[int]],
    card_n_gpus: Optional[int],
    expected_vendor: str = "",
    variable: str = "SLURM_JOB_GPUS",
) -> List[dict]:
    """What the GPUs gpu_facts sees lack against the allocation's GPU indices (``allocated``, None: none granted), the
    card's ``n_gpus`` (-1: all, 0 or None: none asked) and ``expected_vendor`` (empty: any)."""
    problems = []
    seen = f"{count} {vendor} GPU(s)" if count else "no GPU"
    if allocated:
        beyond = [index for index in allocated if index >= count]
        if beyond:
            problems.append(
                problem(
                    "gpus",
                    f"SLURM granted GPUs {','.join(map(str, allocated))} ({variable}) on {node}, but gpu_facts sees "
                    f"{seen} there",
                    f"check the GPU driver and tools on {node} (amd-smi / nvidia-smi), or drain {node}",
                )
            )
    available = len(allocated) if allocated else count
    if card_n_gpus is not None and card_n_gpus > 0 and available < card_n_gpus:
        granted = f", {len(allocated)} granted" if allocated else ""
        problems.append(
            problem(
                "gpus",
                f"the model card asks n_gpus={card_n_gpus}, {node} has {seen}{granted}",
                f"ask SLURM for {card_n_gpus} GPUs per node (--gres=gpu:{card_n_gpus}) on nodes that have them",
            )
        )
    wanted = (expected_vendor or "").strip().upper()
    if wanted and wanted != VENDOR_NONE.upper() and count and vendor.upper() != wanted:
        problems.append(
            problem(
                "gpus",
                f"the run asks for {wanted} GPUs (gpu_vendor), {node} has {seen}",
                f"run on {wanted} nodes or drop gpu_vendor from the context",
            )
        )
    return problems


def gpu_holders(inspected: Sequence[Mapping[str, Any]]) -> Dict[str, List[str]]:
    """``{container name: [GPU devices or 'gpus (device request)']}`` of ``docker inspect`` output's running
    containers that hold GPUs."""
    holders = {}
    for container in inspected:
        if not (container.get("State") or {}).get("Running"):
            continue
        host = container.get("HostConfig") or {}
        held = [
            device.get("PathOnHost", "")
            for device in host.get("Devices") or []
            if str(device.get("PathOnHost", "")).startswith(_GPU_DEVICE_PREFIXES)
        ]
        for request in host.get("DeviceRequests") or []:
            if "gpu" in [cap for caps in request.get("Capabilities") or [] for cap in caps]:
                held.append("gpus (device request)")
        if held:
            holders[str(container.get("Name", "")).lstrip("/")] = held
    return holders


def stale_gpu_problems(node: str, holders: Mapping[str, Sequence[str]], reasons: Mapping[str, str]) -> List[dict]:
    """One problem per container of this user still holding GPUs (``reasons``: why stale_containers kept it)."""
    return [
        problem(
            "stale_gpu_containers",
            f"container {name} of this user still holds {', '.join(devices)} on {node}"
            + (f" ({reasons[name]})" if reasons.get(name) else ""),
            f"end its job (scancel) or remove it: docker rm -f {name} on {node}",
        )
        for name, devices in sorted(holders.items())
    ]


def _stale_gpu_containers(node: str) -> List[dict]:
    # Imported here: stale_containers asks SLURM about jobs, needed only on a node with GPUs.
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import (
        current_user,
        remove_stale_containers,
    )

    kept = remove_stale_containers(current_user(), check_mode=True).kept
    if not kept:
        return []
    inspected = json.loads(run_docker(["inspect", *[v.name for v in kept]], timeout=DOCKER_TIMEOUT).stdout or "[]")
    return stale_gpu_problems(node, gpu_holders(inspected), {v.name: v.reason for v in kept})


# --- clock ---------------------------------------------------------------------------------------------------------


def clock_problem(node: str, now: float, reference: float, bound: float, source: str) -> Optional[Dict[str, str]]:
    """The clock check's verdict: this node's ``now`` against ``reference`` (both epoch seconds)."""
    skew = now - reference
    if abs(skew) <= bound:
        return None
    return problem(
        "clock",
        f"{node}'s clock is {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} {source} (bound {bound:g} s)",
        f"synchronise {node}'s clock (chrony/ntpd), or raise preflight_max_clock_skew",
    )


def filesystem_time(directory: str) -> Optional[float]:
    """The shared filesystem's clock: the mtime of a file just written into ``directory`` (None if it cannot)."""
    path = os.path.join(directory, f".preflight-clock.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(path, "w"):
            pass
        try:
            return os.stat(path).st_mtime
        finally:
            os.unlink(path)
    except OSError:
        return None


# --- all checks ----------------------------------------------------------------------------------------------------


def node_preflight(settings: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Run every enabled check on this node: ``{"node", "problems", "notes", "time"}``. ``settings``: the node_preflight
    module's options, all optional here, plus ``scratch_dir`` (default: the env file's node-local dir)."""
    environ = environ if environ is not None else os.environ
    node = settings.get("node") or environ.get("SLURMD_NODENAME") or socket.gethostname()
    checks = set(CHECKS if settings.get("checks") is None else settings["checks"])
    unknown = checks - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown preflight checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    problems: List[dict] = []
    notes: List[str] = []
    now = time.time()

    if "clock" in checks:
        reference, source = settings.get("reference_time"), "the controller's"
        if reference is None and settings.get("clock_dir"):
            reference, source = filesystem_time(settings["clock_dir"]), "the shared filesystem's"
            now = time.time()
        if reference is None:
            notes.append("clock: no reference time, not checked")
        else:
            max_skew = float(settings.get("max_clock_skew", SETTING_DEFAULTS["preflight_max_clock_skew"]))
            found = clock_problem(node, now, float(reference), max_skew, source)
            problems += [found] if found else []

    root = None
    if "docker" in checks or "disk" in checks or "stale_gpu_containers" in checks:
        root, found = docker_root_dir(node)
        problems += [found] if found and "docker" in checks else []

    if "disk" in checks:
        image_bytes = settings.get("image_bytes") or known_image_bytes(
            settings.get("image_ids") or (), settings.get("image_cache_dir")
        )
        if root is None:
            notes.append("disk: not checked, Docker does not answer")
        else:
            try:
                free = free_bytes(root)
            except OSError as exc:
                free = None
                notes.append(f"disk: cannot read the free space under {root} ({exc.strerror})")
            if free is not None:
                if not image_bytes:
                    notes.append("disk: the image's size is unknown, only the headroom was checked")
                headroom = float(settings.get("disk_headroom_gb", SETTING_DEFAULTS["preflight_disk_headroom_gb"]))
                found = disk_problem(node, root, free, image_bytes, headroom)
                problems += [found] if found else []

    if "shared_dir" in checks and settings.get("shared_dirs"):
        nonce = str(settings.get("nonce") or "")
        if settings.get("write_nonce"):
            for entry in settings["shared_dirs"]:
                write_nonce(entry["nonce_file"], nonce)
        problems += shared_dir_problems(node, settings["shared_dirs"], nonce, float(settings.get("nonce_wait", 0)))

    if "scratch" in checks:
        found = scratch_problem(node, settings.get("scratch_dir") or node_local_tmp_dir(environ))
        problems += [found] if found else []

    gpus = None
    if "gpus" in checks or "stale_gpu_containers" in checks:
        gpus = detect_gpus()
    if "gpus" in checks:
        variable = next((name for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS") if environ.get(name)), "")
        try:
            allocated = allocated_gpu_indices(environ)
        except ValueError as exc:
            allocated = None
            problems.append(problem("gpus", f"{exc} on {node}", "check the job's --gres/--gpus request"))
        card = settings.get("card_n_gpus")
        problems += gpu_problems(
            node,
            gpus["vendor"],
            len(gpus["gpus"]),
            allocated,
            None if card in (None, "") else int(card),
            settings.get("gpu_vendor") or "",
            variable or "SLURM_JOB_GPUS",
        )
    if "stale_gpu_containers" in checks and gpus and gpus["vendor"] != VENDOR_NONE and root is not None:
        try:
            problems += _stale_gpu_containers(node)
        except (DockerError, ValueError) as exc:
            notes.append(f"stale_gpu_containers: not checked ({exc})")

    return {"node": node, "problems": problems, "notes": notes, "time": now}


def summary(problems: Sequence[Mapping[str, str]]) -> str:
    """The problems in one line: ``"<problem>; <problem>"``."""
    return "; ".join(str(item.get("problem", item)) for item in problems)


def main(argv: Sequence[str], check=None) -> int:
    """``--json '<settings>'``: print this node's result (``check(settings)``, default `node_preflight`) as one JSON
    line; exit 1 with problems."""
    if len(argv) != 2 or argv[0] != "--json":
        sys.stderr.write("usage: preflight.py --json '<settings json>'\n")
        return 2
    try:
        settings = json.loads(argv[1])
        if not isinstance(settings, dict):
            raise ValueError("the settings must be a JSON object")
        result = (check or node_preflight)(settings)
    except (ValueError, UserError) as exc:
        sys.stderr.write(f"preflight: bad settings: {exc}\n")
        return 2
    print(json.dumps(result))
    return 1 if result["problems"] else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
