"""Build the slurm_multi.pipeline Ansible collection from the checkout (`make collection`).

    python -m slurm_multi.collection [--output DIR]

The checkout's collections/ansible_collections/slurm_multi/pipeline is the collection's skeleton (galaxy.yml,
meta/runtime.yml, and links to the checkout's library/, module_utils/ and plugins/). This copies it with the linked
files themselves, adds the roles, the playbooks with their group_vars, the sample models and an inventory file, and
packs it with `ansible-galaxy collection build`; it prints the tarball's path (docs/cluster.md, "Installing as a
collection").
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from slurm_multi.paths import project_root

NAMESPACE, NAME = "slurm_multi", "pipeline"
SKELETON = f"collections/ansible_collections/{NAMESPACE}/{NAME}"
# Beside the skeleton's plugins: the checkout's folders of the same name. playbooks/group_vars is a link to
# ../group_vars, copied as its files too.
FOLDERS = ("roles", "playbooks", "models")
# Not content: the roles' molecule scenarios test them in the checkout, and bytecode is the installer's Python's.
LEFT_OUT = shutil.ignore_patterns("molecule", "__pycache__", "*.pyc")
# The inventory source a user copies beside their ansible.cfg: an installed collection's plugins go by their full name.
INVENTORY = f"""\
# The SLURM allocation this runs in, as inventory (outside one: localhost as a one-node run).
plugin: {NAMESPACE}.{NAME}.slurm_allocation
"""


def assemble(root: Path, collection: Path) -> Path:
    """The collection's tree, real files only, at ``collection`` (emptied first), from the checkout at ``root``."""
    shutil.rmtree(collection, ignore_errors=True)
    shutil.copytree(root / SKELETON, collection, ignore=LEFT_OUT)  # links followed: their files are copied
    for folder in FOLDERS:
        shutil.copytree(root / folder, collection / folder, ignore=LEFT_OUT)
    (collection / "inventory").mkdir()
    (collection / "inventory" / "slurm.yml").write_text(INVENTORY)
    return collection


def build(output: Path, root: Path | None = None) -> Path:
    """Assemble the collection under ``output`` and pack it there; the tarball's path."""
    collection = assemble(root or project_root(), output / "ansible_collections" / NAMESPACE / NAME)
    galaxy = shutil.which("ansible-galaxy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        [galaxy or "ansible-galaxy", "collection", "build", "--force", "--output-path", str(output), str(collection)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    version = yaml.safe_load((collection / "galaxy.yml").read_text())["version"]
    return output / f"{NAMESPACE}-{NAME}-{version}.tar.gz"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_multi.collection", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("build/collection"), help="default: build/collection")
    args = parser.parse_args(argv)
    print(build(args.output.absolute()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
