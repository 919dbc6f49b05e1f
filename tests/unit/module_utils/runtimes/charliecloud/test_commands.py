"""Finding Charliecloud's commands: one reached through a symlink on PATH (a site's symlink farm: Spack views,
environment modules; the lab's PATH with no docker) still runs."""

import getpass
import os
import shutil
import subprocess

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.commands import ch_image_argv


def test_ch_image_found_through_a_symlink_on_path_runs(tmp_path):
    real = shutil.which("ch-image", path="/usr/bin")
    if real is None:
        pytest.skip("needs Charliecloud's ch-image (Debian's charliecloud)")
    farm = tmp_path / "bin"
    farm.mkdir()
    (farm / "ch-image").symlink_to(real)
    argv = ch_image_argv(["--version"], environ={"PATH": str(farm)})
    # ch-image finds its own modules beside its path: it must be run by its real one.
    ran = subprocess.run(
        argv, capture_output=True, text=True, env=dict(os.environ, PATH=str(farm), USER=getpass.getuser())
    )
    assert ran.returncode == 0, ran.stderr
    assert (ran.stdout + ran.stderr).strip().startswith("0.")
