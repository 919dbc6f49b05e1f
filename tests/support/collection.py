"""The slurm_multi.pipeline collection as its users get it: built from the checkout (`make collection`), installed
with ansible-galaxy outside the checkout, run from a directory of the user's with the collection's README's config."""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from slurm_multi.collection import SKELETON, build
from tests.support.ansible import BIN, ROOT

README = ROOT / SKELETON / "README.md"


@dataclass
class InstalledCollection:
    tarball: Path
    collections_path: Path

    @property
    def root(self) -> Path:
        return self.collections_path / "ansible_collections" / "slurm_multi" / "pipeline"


def user_env(collections_path: Path, **extra) -> dict:
    """This environment as a user's outside the checkout: none of the suite's Ansible settings, no allocation, no
    slurm-multi mode; the installed collections path."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ANSIBLE_", "SLURM_")) and name != "PYTHONPATH"
    }
    env.update(ANSIBLE_COLLECTIONS_PATH=str(collections_path), ANSIBLE_NOCOLOR="1", **extra)
    return env


def install_built_collection(work: Path) -> InstalledCollection:
    """The collection built under ``work``/build and installed into ``work``/collections, ansible-galaxy started in
    ``work`` (in the checkout, its own collections/ counts as the collection installed already)."""
    tarball = build(work / "build")
    collections_path = work / "collections"
    installed = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "install", str(tarball), "-p", str(collections_path)],
        cwd=work,
        env=user_env(collections_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return InstalledCollection(tarball, collections_path)


def readme_ansible_cfg() -> str:
    """The ansible.cfg the collection's README gives its users (the indented block after "`ansible.cfg`:")."""
    block = re.search(r"^`ansible\.cfg`:\n\n((?:    .*\n|\n)+)", README.read_text(), re.MULTILINE)
    assert block, f"{README} gives no ansible.cfg block"
    return textwrap.dedent(block.group(1)).strip() + "\n"


def python_without_the_package(venv: Path) -> str:
    """A venv's Python with this venv's dependencies (ansible-core, python-hostlist, pandas) but not the slurm_multi
    package: its site-packages is this venv's, whose editable install's finder is a .pth file that a plain path entry
    does not run."""
    subprocess.run([str(BIN / "python"), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (next(venv.glob("lib/python*/site-packages")) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return str(venv / "bin" / "python")
