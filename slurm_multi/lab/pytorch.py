"""The lab's PyTorch base image: Debian bookworm with its Python 3.11 and the torch 2.13.0 CPU wheel, built offline.

Real distributed jobs (torchrun, DDP over gloo) run from it on the lab's CPUs (the sample model `pyt_ddp_tiny`). Its
root filesystem is made once per machine and kept as a tar (``BASE_TAR``), which ``docker import`` makes
``PYTORCH_BASE`` on each node asked for (node1 alone by default: the workers get the model's image from the cache).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from slurm_multi.lab.cluster import MAX_NODES, PYTORCH_BASE, PYTORCH_BASE_TAR, LabError, LabNode, docker_env, lab_nodes

TORCH_REQUIREMENT = "torch==2.13.0"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_TAR = PYTORCH_BASE_TAR
# Debian's python3 in bookworm: the wheel's ABI (cp311) must match it.
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"
# torch's own entry point, as its wheel's console script names it.
TORCHRUN_SCRIPT = "#!/usr/bin/python3\nimport sys\nfrom torch.distributed.run import main\n\nsys.exit(main())\n"
# Which tar a node's base was imported from (its size and mtime): a rebuilt tar is imported again.
BASE_LABEL = "slurm-multi-lab.base-tar"
# One thread per rank: the lab's ranks share two cores.
IMAGE_CHANGES = ("ENV OMP_NUM_THREADS=1", "ENV PYTHONUNBUFFERED=1", "WORKDIR /myworkspace", 'CMD ["/bin/sh"]')


def _run(argv: list[str], what: str, **kwargs) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise LabError(f"{what} failed (exit {result.returncode}): {(result.stderr or result.stdout)[-1500:]}")


def _ensure_debootstrap(progress) -> None:
    if shutil.which("debootstrap"):
        return
    progress("installing Debian's debootstrap")
    _run(["apt-get", "update", "-q"], "apt-get update")
    _run(["apt-get", "install", "-y", "-q", "debootstrap"], "apt-get install debootstrap")


def build_base_tar(progress=print) -> Path:
    """``BASE_TAR``, made now unless it is there (a few minutes, once per machine)."""
    if BASE_TAR.is_file():
        return BASE_TAR
    _ensure_debootstrap(progress)
    BASE_TAR.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BASE_TAR.parent, prefix=".building-") as work:
        root = Path(work) / "root"
        progress(f"debootstrap: Debian {DEBIAN_SUITE} with python3 into {root} (once per machine)")
        _run(
            ["debootstrap", "--variant=minbase", "--include=python3", DEBIAN_SUITE, str(root), DEBIAN_MIRROR],
            "debootstrap",
        )
        progress(f"pip: {TORCH_REQUIREMENT} (the CPU wheel on this machine's disk) into the root's {SITE_PACKAGES}")
        _run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(root / SITE_PACKAGES)]
            + ["--no-warn-script-location", TORCH_REQUIREMENT],
            f"pip install {TORCH_REQUIREMENT}",
        )
        # pip --target writes console scripts for this interpreter: the image gets its own torchrun instead.
        shutil.rmtree(root / SITE_PACKAGES / "bin", ignore_errors=True)
        torchrun = root / "usr/local/bin/torchrun"
        torchrun.write_text(TORCHRUN_SCRIPT)
        torchrun.chmod(0o755)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / cache, ignore_errors=True)
        partial = BASE_TAR.with_suffix(".tar.partial")
        _run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], "tar of the root filesystem")
        os.replace(partial, BASE_TAR)  # whole or absent: a cut-off build leaves no tar to trust
    progress(f"{BASE_TAR}: {BASE_TAR.stat().st_size / 1e9:.2f} GB")
    return BASE_TAR


def _tar_identity(tar: Path) -> str:
    info = tar.stat()
    return f"{info.st_size}-{info.st_mtime_ns}"


def base_label(node: LabNode) -> str | None:
    """The ``BASE_LABEL`` of the node's ``PYTORCH_BASE`` (which tar it was imported from), None when it has none."""
    inspect = ["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{BASE_LABEL}"}}}}', PYTORCH_BASE]
    result = subprocess.run(inspect, env=docker_env(node), capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def ensure_pytorch_base(node_names=("node1",), progress=print) -> list[str]:
    """Import ``PYTORCH_BASE`` from ``BASE_TAR`` (built first if need be) on each named node that lacks that very
    import; returns the nodes it imported on."""
    nodes = {node.name: node for node in lab_nodes(MAX_NODES)}
    imported = []
    for name in node_names:
        if name not in nodes:
            raise LabError(f"{name} is no lab node (node1..node8)")
        tar = build_base_tar(progress)
        if base_label(nodes[name]) == _tar_identity(tar):
            continue
        progress(f"{name}: docker import {tar.name} as {PYTORCH_BASE}")
        argv = ["docker", "import", "--change", f"LABEL {BASE_LABEL}={_tar_identity(tar)}"]
        for change in IMAGE_CHANGES:
            argv += ["--change", change]
        _run(argv + [str(tar), PYTORCH_BASE], f"{name}: docker import", env=docker_env(nodes[name]))
        imported.append(name)
    return imported


def remove_pytorch_base(node_names, progress=print) -> None:
    """Remove ``PYTORCH_BASE`` from each named node (a test that wants the workers to lack it)."""
    nodes = {node.name: node for node in lab_nodes(MAX_NODES)}
    for name in node_names:
        if base_label(nodes[name]) is not None:
            progress(f"{name}: docker rmi {PYTORCH_BASE}")
            _run(["docker", "rmi", PYTORCH_BASE], f"{name}: docker rmi", env=docker_env(nodes[name]))
