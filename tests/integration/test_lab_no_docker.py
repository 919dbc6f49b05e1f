"""The lab for a site without Docker: its user reaches no daemon, yet runs the lab's base under `ch-run` in every
node's job steps, each node with storage of its own; a node can be made FUSE-less, as many sites' nodes are, or
without ch-run.

One squashfs of the lab's busybox base (made by the user, as rank 0 makes an image) serves the whole module; each
test runs one srun over the three nodes.
"""

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from slurm_multi.lab import cluster as lab
from tests.support.lab.hidden_paths import CH_RUN, FUSE_DEVICE, hidden
from tests.support.users.local_users import NODOCKER, TEAM, USER, ensure_user, run_as
from tests.support.users.no_docker import assert_no_docker_reachable, ensure_nodocker_user, no_docker_path
from tests.support.users.user_venv import ensure_user_venv

# lab_serial: no other test's job may meet a node without FUSE or ch-run.
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent, pytest.mark.lab_serial]

NODES = "node[1-3]"


@pytest.fixture(scope="module")
def user_path(lab_cluster):
    ensure_nodocker_user()
    return no_docker_path(ensure_user_venv())


@pytest.fixture(scope="module")
def busybox_squashfs(user_path):
    """The lab's busybox base as a squashfs file on the shared /tmp, the user's own."""
    place = Path(tempfile.mkdtemp(prefix="slurm-multi-no-docker-"))
    place.chmod(0o755)
    tree = place / "tree"
    tree.mkdir()
    subprocess.run(["tar", "-C", str(tree), "-xf", str(lab.ensure_busybox_tar())], check=True)
    shutil.chown(place, NODOCKER)
    squashfs = place / "busybox.sqfs"
    made = run_as(NODOCKER, ["env", f"PATH={user_path}", "mksquashfs", str(tree), str(squashfs), "-quiet"])
    assert made.returncode == 0, made.stderr
    yield squashfs
    shutil.rmtree(place)


def _srun_as_user(path: str, *argv: str, nodes: str = NODES) -> subprocess.CompletedProcess:
    return run_as(NODOCKER, ["env", f"PATH={path}", "srun", "-N", "3", "-w", nodes, "-l", *argv], timeout=120)


def test_the_user_of_a_site_without_docker_reaches_no_daemon(user_path):
    assert_no_docker_reachable(user_path)


def test_the_proof_that_no_daemon_is_reachable_fails_for_a_member_of_the_docker_group(lab_cluster):
    ensure_user(USER, groups=(TEAM, lab.DOCKER_GROUP))
    with pytest.raises(AssertionError, match="can open Docker sockets"):
        assert_no_docker_reachable("/usr/bin:/bin", user=USER)


def test_the_users_ch_run_runs_one_shared_squashfs_in_every_nodes_job_step(user_path, busybox_squashfs):
    ran = _srun_as_user(user_path, "ch-run", str(busybox_squashfs), "--", "sh", "-c", "echo $(hostname) $(id -un)")
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == [f"{rank}: node{rank + 1} {NODOCKER}" for rank in range(3)]


def test_each_node_has_node_local_storage_of_its_own(user_path):
    # Each node writes its name into the node-local folder, then lists it: it sees its own file only.
    script = f"d={lab.NODE_LOCAL_DIR}/{NODOCKER}-probe; mkdir -p $d; hostname > $d/$(hostname); ls $d; rm -r $d"
    ran = _srun_as_user(user_path, "sh", "-c", script)
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == ["0: node1", "1: node2", "2: node3"]


def test_a_node_without_fuse_refuses_the_squashfs_and_runs_the_unpacked_image(user_path, busybox_squashfs):
    unpack = (
        f"d={lab.NODE_LOCAL_DIR}/{NODOCKER}-unpacked; rm -rf $d; unsquashfs -q -n -d $d {busybox_squashfs} >/dev/null"
        f" && ch-run $d -- hostname; rm -rf $d"
    )
    script = f"ch-run {busybox_squashfs} -- hostname || {{ echo no squashfs; {unpack}; }}"
    with hidden([lab.LabNode(3)], FUSE_DEVICE):
        ran = _srun_as_user(user_path, "sh", "-c", script)
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == ["0: node1", "1: node2", "2: no squashfs", "2: node3"]
    assert "/dev/fuse" in ran.stderr
    # FUSE is back once the block is left.
    again = _srun_as_user(user_path, "ch-run", str(busybox_squashfs), "--", "hostname")
    assert sorted(again.stdout.splitlines()) == ["0: node1", "1: node2", "2: node3"], again.stderr


def test_a_node_whose_ch_run_is_hidden_has_none_the_user_can_run_and_gets_it_back(user_path, busybox_squashfs):
    with hidden([lab.LabNode(2)], CH_RUN):
        ran = _srun_as_user(user_path, "sh", "-c", f"ch-run {busybox_squashfs} -- hostname || echo no ch-run")
    assert sorted(ran.stdout.splitlines()) == ["0: node1", "1: no ch-run", "2: node3"], ran.stderr
    again = _srun_as_user(user_path, "ch-run", str(busybox_squashfs), "--", "hostname")
    assert sorted(again.stdout.splitlines()) == ["0: node1", "1: node2", "2: node3"], again.stderr
