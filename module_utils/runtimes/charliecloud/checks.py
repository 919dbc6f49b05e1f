"""Preflight under Charliecloud: what this node needs to run (and, on rank 0, build) the job with no Docker daemon.

ch-run and its version, user namespaces (`ch-checkns`), whether this user can mount squashfs here (the image runs
in place) or the node must unpack it (then unsquashfs and room in the unpack dir), and the shared cache's trust.
Each problem names its fix; what applies on this node (in place or unpack) is said in the notes and `image_access`."""

from __future__ import annotations

import os
import subprocess
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    ImageCacheError,
    open_cache_dir,
    resolve_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.commands import (
    CharliecloudError,
    command_version,
    find_command,
    lark_python,
    version_tuple,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.image import (
    resolve_unpack_dir,
    squashfs_mountable,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

CHECK = "charliecloud"
# --set-env=FILE, --unset-env=GLOB and -b creating nothing in a read-only image: the flags the run side uses.
MIN_CH_RUN = (0, 26)
CHECKNS_TIMEOUT = 30.0
INSTALL = "apt-get install charliecloud squashfs-tools squashfuse (Debian/Ubuntu), or OpenHPC's charliecloud package,"


def _problem(text: str, fix: str) -> Dict[str, str]:
    return {"check": CHECK, "problem": text, "fix": fix}


def _free_bytes(path: str) -> int:
    """Free bytes for this user on the filesystem of `path` (or of its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    status = os.statvfs(path)
    return status.f_bavail * status.f_frsize


def charliecloud_checks(
    node: str, settings: Mapping[str, Any], builds: bool = False
) -> Tuple[List[dict], List[str], str]:
    """(problems, notes, image_access) of this node: `image_access` is "in-place" or "unpack". `builds`: this node
    builds the image (rank 0), so ch-image, its lark and mksquashfs count too."""
    problems: List[dict] = []
    notes: List[str] = []
    ch_run = find_command("ch-run")
    if ch_run is None:
        problems.append(
            _problem(
                f"ch-run is not installed on {node} (container_runtime charliecloud runs every rank with it)",
                f"install Charliecloud on {node}: {INSTALL} or leave {node} out (--exclude {node})",
            )
        )
    else:
        version = command_version("ch-run") or ""
        if version_tuple(version) and version_tuple(version) < MIN_CH_RUN:
            wanted = ".".join(map(str, MIN_CH_RUN))
            problems.append(
                _problem(f"ch-run {version} on {node} is older than {wanted}", f"install {wanted} or newer")
            )
        notes.append(f"charliecloud: ch-run {version or 'of unknown version'} at {ch_run}")
        problems += _user_namespace_problems(node)
    problems += _tool_problems(node, builds, notes)
    access = _image_access(node, settings, problems, notes)
    problems += _cache_problems(settings)
    return problems, notes, access


def _user_namespace_problems(node: str) -> List[dict]:
    checkns = find_command("ch-checkns")
    if checkns is None:
        return []
    try:
        ran = subprocess.run([checkns], capture_output=True, text=True, timeout=CHECKNS_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return [_problem(f"ch-checkns did not run on {node}: {error}", "check the Charliecloud install on that node")]
    if ran.returncode == 0:
        return []
    said = (ran.stderr or ran.stdout).strip().splitlines()
    return [
        _problem(
            f"unprivileged user namespaces do not work on {node} (ch-checkns: {said[-1] if said else ran.returncode})",
            "an administrator enables them: sysctl user.max_user_namespaces=15000 (and, on Debian kernels, "
            "kernel.unprivileged_userns_clone=1)",
        )
    ]


def _tool_problems(node: str, builds: bool, notes: List[str]) -> List[dict]:
    """ch-image (with lark) and mksquashfs, which rank 0 builds with: problems there, notes elsewhere."""
    missing = [tool for tool in ("ch-image", "mksquashfs") if find_command(tool) is None]
    try:
        lark_python()
    except CharliecloudError:
        missing.append("python3-lark (ch-image's parser)")
    if not missing:
        return []
    text = f"{', '.join(missing)} missing on {node}"
    if not builds:
        notes.append(f"charliecloud: {text} (only rank 0 builds)")
        return []
    return [_problem(f"{text}: rank 0 builds the image with them", f"install them on {node}: {INSTALL.rstrip(',')}")]


def _image_access(node: str, settings: Mapping[str, Any], problems: List[dict], notes: List[str]) -> str:
    mountable, why = squashfs_mountable()
    if mountable:
        notes.append(f"charliecloud: {node} runs the shared squashfs in place ({why})")
        return "in-place"
    unpack_dir = resolve_unpack_dir(str(settings.get("charliecloud_unpack_dir") or "/var/tmp/slurm-multi-%u/images"))
    notes.append(f"charliecloud: {node} must unpack the image once into {unpack_dir} ({why})")
    if find_command("unsquashfs") is None:
        problems.append(
            _problem(
                f"{node} cannot mount squashfs ({why}) and has no unsquashfs to unpack the image",
                f"install squashfs-tools on {node}, or give this user /dev/fuse there",
            )
        )
    try:
        descriptor = open_cache_dir(unpack_dir, create=False)
    except ImageCacheError as error:
        problems.append(_problem(str(error), "choose another charliecloud_unpack_dir, node-local and yours"))
    else:
        if descriptor is not None:
            os.close(descriptor)
    wanted = int(settings.get("image_bytes") or 0) + int(float(settings.get("disk_headroom_gb") or 0) * 1e9)
    free = _free_bytes(unpack_dir)
    if wanted and free < wanted:
        problems.append(
            _problem(
                f"{node} has {free / 1e9:.1f} GB free under {unpack_dir}, less than the {wanted / 1e9:.1f} GB the "
                "unpacked image and the headroom need",
                "free space there, or set charliecloud_unpack_dir to a node-local dir with room",
            )
        )
    return "unpack"


def _cache_problems(settings: Mapping[str, Any]) -> List[dict]:
    """The shared cache, when it exists: ours or root's, not writable by others (a planted squashfs would run)."""
    option: Optional[str] = settings.get("image_cache_dir")
    if not option:
        return []
    try:
        descriptor = open_cache_dir(resolve_cache_dir(option), create=False)
    except UserError as error:
        return [_problem(str(error), "fix the image cache dir's owner or mode, or choose another image_cache_dir")]
    if descriptor is not None:
        os.close(descriptor)
    return []
