"""Charliecloud for the tests: a tiny busybox root filesystem, a one-card model zoo over it, and this file as a script
that an ordinary user runs (Debian's python3, the checkout's collections/ on PYTHONPATH) to build, publish and make
images ready with module_utils/runtimes/charliecloud, printing one JSON line.

    python3 charliecloud.py build '<json: zoo, cache_dir, storage_dir, bases, log_dir, secrets_file, context>'
    python3 charliecloud.py ready '<json: squashfs, image_id, unpack_dir, mountable>'
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "cat", "echo", "test", "ls", "true", "mkdir", "grep", "sha256sum", "cut", "id", "hostname")
CARD = {"name": "chtest", "dockerfile": "docker/chtest", "tags": ["chtest"], "args": ""}
BASE_NAME = "chtest-base"
CONTEXT = {"docker_build_arg": {"BASE_DOCKER": BASE_NAME}, "gpu_vendor": "AMD", "guest_os": "UBUNTU"}
CH_TOOLS = ("ch-image", "ch-run", "mksquashfs", "unsquashfs")


def make_rootfs(root) -> None:
    """A busybox root filesystem at `root`: a shell and a few applets, /etc/passwd and /etc/group for ch-run."""
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "etc"))
    shutil.copy(BUSYBOX, os.path.join(root, "bin", "busybox"))
    for applet in APPLETS:
        os.symlink("busybox", os.path.join(root, "bin", applet))
    with open(os.path.join(root, "etc", "passwd"), "w") as handle:
        handle.write("root:x:0:0:root:/:/bin/sh\n")
    with open(os.path.join(root, "etc", "group"), "w") as handle:
        handle.write("root:x:0:\n")


def make_rootfs_tar(root, tar) -> None:
    make_rootfs(root)
    subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tar), "."], check=True)


def write_zoo(zoo, dockerfile: str) -> None:
    """A model zoo at `zoo` whose one card builds `dockerfile`."""
    os.makedirs(os.path.join(zoo, "docker"), exist_ok=True)
    with open(os.path.join(zoo, "docker", "chtest.Dockerfile"), "w") as handle:
        handle.write(dockerfile)


def _build(options: dict) -> dict:
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import plan_image_builds
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import CacheDirectory
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.build import (
        CharliecloudBuild,
        ensure_image,
    )

    context = options.get("context") or CONTEXT
    plan = plan_image_builds(options["zoo"], [CARD], context, options["log_dir"], options.get("secrets_file"))[0]
    cache = CacheDirectory(options["cache_dir"])
    build = CharliecloudBuild(cache, options["storage_dir"], options["bases"], options.get("mount_points", ()))
    outcome, squashfs = ensure_image(cache, plan, build, force_rebuild=options.get("force_rebuild", False))
    return {
        "action": outcome.action,
        "image_id": outcome.image_id,
        "squashfs": squashfs,
        "fingerprint": outcome.plan.fingerprint,
        "base_images": outcome.plan.base_images,
        "log_file": plan.log_file,
    }


def _ready(options: dict) -> dict:
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.image import make_ready

    return make_ready(options["squashfs"], options["image_id"], options["unpack_dir"], options.get("mountable"))


def main(argv) -> int:
    command, options = argv[0], json.loads(argv[1])
    try:
        result = {"build": _build, "ready": _ready}[command](options)
    except Exception as error:  # noqa: BLE001 - the test reads the error's type and message
        print(json.dumps({"error": type(error).__name__, "msg": str(error)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
