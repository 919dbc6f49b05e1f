"""The docker CLI that builds with BuildKit on this machine, for tests of Dockerfiles using `RUN --mount`.

The machine's `docker` on PATH may be a CLI 23+ without its buildx component, which cannot build with BuildKit;
Debian's docker.io (the lab's Docker 20.10) installs a CLI with BuildKit built in at /usr/bin/docker.
"""

import re
import shutil
import subprocess

import pytest

DEBIAN_DOCKER_CLI = "/usr/bin/docker"


def _has_buildkit(cli: str) -> bool:
    if subprocess.run([cli, "buildx", "version"], capture_output=True).returncode == 0:
        return True
    version = subprocess.run([cli, "--version"], capture_output=True, text=True).stdout
    major = re.search(r"version (\d+)\.", version)
    return bool(major) and int(major.group(1)) < 23


def buildkit_docker_cli() -> str:
    """`docker` when it can build with BuildKit, else /usr/bin/docker when that can; the test fails otherwise."""
    for cli in ("docker", DEBIAN_DOCKER_CLI):
        if shutil.which(cli) and _has_buildkit(cli):
            return cli
    pytest.fail(
        "no docker CLI with BuildKit on this machine: install the buildx component, or Debian's docker.io "
        f"(a 20.10 CLI at {DEBIAN_DOCKER_CLI})"
    )


def docker_cli_without_buildkit():
    """A real docker CLI on this machine that cannot build with BuildKit (23+ without buildx), or None."""
    for cli in ("docker", "/usr/local/bin/docker"):
        found = shutil.which(cli)
        if found and not _has_buildkit(found):
            return found
    return None
