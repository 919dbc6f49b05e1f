"""The lab's busybox base as a root filesystem tar: what a user with no Docker builds the sample models on (no lab
needed: the tar is made in a folder of the test's own and run by a real `ch-run`, as that user)."""

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import settings_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTINGS
from slurm_multi.lab import cluster as lab
from tests.support.users.local_users import NODOCKER, run_as
from tests.support.users.no_docker import ensure_nodocker_user


@pytest.fixture
def bases_dir(monkeypatch):
    place = Path(tempfile.mkdtemp(prefix="slurm-multi-lab-bases-"))
    place.chmod(0o755)
    monkeypatch.setattr(lab, "BASES_DIR", place)
    monkeypatch.setattr(lab, "BUSYBOX_BASE_TAR", place / "busybox.tar")
    yield place
    shutil.rmtree(place)


def test_the_busybox_base_tar_runs_under_ch_run_as_a_user_with_no_docker(bases_dir):
    if shutil.which("ch-run") is None:
        pytest.skip("needs Charliecloud's ch-run (Debian's charliecloud)")
    ensure_nodocker_user()
    tar = lab.ensure_busybox_tar()
    tree = bases_dir / "tree"
    tree.mkdir()
    subprocess.run(["tar", "-C", str(tree), "-xf", str(tar)], check=True)
    # ch-run binds the host's /etc/passwd, /etc/group and /tmp over the tree's: the run needs them in place.
    ran = run_as(NODOCKER, ["env", "PATH=/usr/bin", "ch-run", str(tree), "--", "sh", "-c", "id -un; ls -d /tmp"])
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == [NODOCKER, "/tmp"]


def test_the_busybox_base_tar_is_made_once(bases_dir):
    tar = lab.ensure_busybox_tar()
    made = tar.stat().st_mtime_ns
    assert lab.ensure_busybox_tar() == tar and tar.stat().st_mtime_ns == made
    assert [path.name for path in bases_dir.iterdir()] == ["busybox.tar"]  # no temp folder left


def test_the_lab_site_file_names_its_bases_and_node_local_unpack_dir_and_is_accepted(tmp_path):
    # Whatever the checkout's settings are, the lab's site file is one its settings reader accepts (a file naming a
    # setting the reader does not know is refused, and every job with it); with the runtime's settings it names them.
    site = tmp_path / "site.yml"
    site.write_text(lab._site_config(lab.lab_nodes(3)))
    site.chmod(0o644)
    settings = settings_files.read_settings(environ={"HOME": str(tmp_path)}, site_config=str(site))
    assert settings.node_addresses == {"node1": "127.0.0.11", "node2": "127.0.0.12", "node3": "127.0.0.13"}
    if "charliecloud_bases" in SETTINGS:
        bases = {lab.BASE_IMAGE: str(lab.BUSYBOX_BASE_TAR), lab.PYTORCH_BASE: str(lab.PYTORCH_BASE_TAR)}
        assert settings.values["charliecloud_bases"] == bases
    if "charliecloud_unpack_dir" in SETTINGS:
        assert settings.values["charliecloud_unpack_dir"] == f"{lab.NODE_LOCAL_DIR}/slurm-multi-%u/images"
