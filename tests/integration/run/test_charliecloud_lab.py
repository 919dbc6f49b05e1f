"""The whole pipeline under Charliecloud on the 3-node lab, submitted by a user of a site without Docker.

The user (local_users.NODOCKER) is in no docker group and has no docker command on PATH; the module first proves it
reaches no Docker daemon (tests/support/users/no_docker.py), so every job here that runs used none. It submits from a
venv of its own with `-e container_runtime=charliecloud`, under the lab's site settings as this checkout writes them
(`charliecloud_bases`: the lab's bases as root filesystem tars; `charliecloud_unpack_dir`: node-local), named by
$SLURM_MULTI_SITE_CONFIG so that another checkout's `lab up` cannot change them under the test.

Five jobs, each read by several tests:

* ddp: the PyTorch DDP sample on 3 nodes (its base imported from the lab's PyTorch base tar), started through MAD's
  launcher contract ($MAD_MULTI_NODE_RUNNER: torchrun), with a secret that reaches every rank and no output;
* crash: a busybox probe whose rank 1 fails at once while the others wait: fail-fast; node3 has no FUSE, so it
  unpacks the image into its node-local storage; no process is left;
* cancel: the same image, every rank waiting, cancelled with scancel: no process left; node3's unpacked image was
  torn before it (its completion marker and busybox gone), and is unpacked again rather than run;
* hang: a rank-wide sleep on the PyTorch base with hang_timeout 10 s: a hang, named with every rank's stacks;
* preflight: `submit --preflight` on node[1-3] with node3's ch-run hidden, and the busybox base changed in the user's
  settings: node3 is left out naming the fix, and the image is rebuilt over the new base.
"""

import copy
import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from slurm_multi.lab import cluster as lab
from tests.support.lab.hidden_paths import CH_RUN, FUSE_DEVICE, hidden
from tests.support.lab.per_mode_jobs import in_mode
from tests.support.users.local_users import NODOCKER, run_as
from tests.support.users.no_docker import assert_no_docker_reachable, ensure_nodocker_user, no_docker_path
from tests.support.users.user_venv import ensure_user_venv

# lab_serial: its jobs hide FUSE or ch-run on node3, which no other test's job may meet.
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent, pytest.mark.lab_serial]

ROOT = Path(__file__).resolve().parents[3]
NODES = ("node1", "node2", "node3")
SECRET_NAME = "MAD_SECRETS_CHPROBE"
HANG_TIMEOUT = 10
NO_FUSE_NODE = lab.LabNode(3)
# Seconds after the job's end a process of it counts as left behind.
LEFT_BEHIND_AFTER = 30

DDP_SECRET_SH = """#!/bin/sh
# The secret's hash, never the secret; then the PyTorch sample through MAD's launcher contract.
set -eu
echo "rank $NODE_RANK runs as $(id -un); secret sha256 $(printf %s "$MAD_SECRETS_CHPROBE" | sha256sum | cut -d' ' -f1)"
exec sh "$(dirname "$0")/run.sh" "$@"
"""
PROBE_SH = """#!/bin/sh
# PROBE_MODE (the context's docker_env_vars): crash - rank 1 fails at once, the others wait; wait - every rank
# waits; quick - the last rank prints a figure.
echo "rank $NODE_RANK on $(hostname) as $(id -un), base $(cat /etc/probe-base 2>/dev/null || echo lab)"
if [ "$PROBE_MODE" = crash ] && [ "$NODE_RANK" = 1 ]; then echo "rank 1 crashes"; exit 3; fi
if [ "$PROBE_MODE" = quick ]; then
  [ "$NODE_RANK" = "$((NNODES - 1))" ] && echo "performance: 1 probes/sec"
  exit 0
fi
echo "rank $NODE_RANK waits"
sleep 300
echo "rank $NODE_RANK done waiting"
"""
HANG_SH = """#!/bin/sh
# Every rank sleeps in Python and prints nothing more: no progress anywhere.
exec python3 -c 'import time
print("rank waits forever", flush=True)
time.sleep(600)'
"""


class UserJob:
    """One job the user submitted: its submit run, results dir and the files its nodes left."""

    def __init__(self, run: subprocess.CompletedProcess, results: Path):
        self.run = run
        self.results = results

    @property
    def output(self) -> str:
        return self.run.stdout + self.run.stderr

    @property
    def job_id(self) -> str:
        return re.search(r"Submitted job (\d+)", self.output).group(1)

    @property
    def job_dir(self) -> Path:
        (job,) = [path for path in self.results.iterdir() if path.is_dir() and path.name.isdigit()]
        return job

    @property
    def attempt_dir(self) -> Path:
        return self.job_dir / "attempt-0"

    @property
    def record(self) -> dict:
        return json.loads((self.results / "records" / f"{self.job_dir.name}.json").read_text())

    @property
    def ansible_output(self) -> str:
        """The job's own output file (its Ansible plays)."""
        return Path(re.search(r"output:\s+(\S+)", self.output).group(1)).read_text()

    def status(self, node: str) -> dict:
        return json.loads((self.attempt_dir / "nodes" / node / "status.json").read_text())

    def log(self, node: str) -> str:
        """The node's run.log so far ("" before the job made it)."""
        found = [path for path in self.results.glob(f"*/attempt-0/nodes/{node}/run.log") if path.is_file()]
        return found[0].read_text() if found else ""

    def image_id(self, node: str = "node1") -> str:
        return self.status(node)["image_id"]


class NoDockerUser:
    """NODOCKER, its venv and PATH, a place of the module's own and the lab's site settings."""

    def __init__(self, place: Path, path: str, venv: Path, site_config: Path, zoo: Path):
        self.place, self.path, self.venv, self.site_config, self.zoo = place, path, venv, site_config, zoo

    def environment(self, **extra: str) -> dict:
        return {"PATH": self.path, "LANG": "C.UTF-8", "SLURM_MULTI_SITE_CONFIG": str(self.site_config), **extra}

    def results_dir(self, name: str) -> Path:
        results = self.place / name
        results.mkdir()
        shutil.chown(results, NODOCKER)
        return results

    def submit(self, name: str, args: list[str], wait: bool = True, **env: str) -> UserJob:
        results = self.results_dir(name)
        argv = [str(self.venv / "bin" / "slurm-multi"), "submit", "--no-exclusive"]
        argv += ["--models-file", str(self.zoo / "models.json"), "--results-dir", str(results)]
        argv += ["-e", "container_runtime=charliecloud", *args] + (["--wait"] if wait else [])
        run = run_as(NODOCKER, argv, cwd=self.place, env=self.environment(**env), timeout=900)
        return UserJob(run, results)


def _card(zoo_cards: list, model: str, name: str, script: str, **fields) -> dict:
    """`model`'s card as `name`, running `script` from the same folder (the one a rank sees of the zoo)."""
    card = copy.deepcopy(next(card for card in zoo_cards if card["name"] == model))
    folder = card["scripts"].rsplit("/", 1)[0]
    card.update(name=name, scripts=f"{folder}/{script}", tags=[name], **fields)
    return card


def _make_zoo(place: Path) -> Path:
    """The sample zoo with the module's cards: over its PyTorch and busybox Dockerfiles, with scripts of their own
    beside the samples' (a rank sees its script's folder)."""
    zoo = place / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    cards = json.loads((zoo / "models.json").read_text())
    hang = _card(cards, "pyt_ddp_tiny", "ch_hang", "hang.sh", args="")
    hang.pop("distributed")
    cards += [
        _card(cards, "pyt_ddp_tiny", "ch_ddp_secret", "ddp_secret.sh", args="--steps 5"),
        _card(cards, "dummy_lastrank", "ch_probe", "probe.sh"),
        hang,
    ]
    (zoo / "models.json").write_text(json.dumps(cards, indent=2))
    for folder, name, text in (
        ("pytorch", "ddp_secret.sh", DDP_SECRET_SH),
        ("dummy", "probe.sh", PROBE_SH),
        ("pytorch", "hang.sh", HANG_SH),
    ):
        (zoo / "scripts" / folder / name).write_text(text)
    for path in [zoo, *zoo.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or path.suffix == ".sh" else 0o644)
    return zoo


@pytest.fixture(scope="module")
def user(lab_cluster):
    ensure_nodocker_user()
    venv = ensure_user_venv()
    path = no_docker_path(venv)
    assert_no_docker_reachable(path)
    lab.ensure_busybox_tar()
    from slurm_multi.lab.pytorch import build_base_tar

    build_base_tar()
    place = Path(tempfile.mkdtemp(prefix="slurm-multi-charliecloud-"))
    place.chmod(0o755)
    # This checkout's lab site settings, whoever's `lab up` wrote /etc/slurm-multi/site.yml last.
    site_config = place / "site.yml"
    site_config.write_text(lab._site_config(lab.lab_nodes(3)))
    assert "charliecloud_bases" in site_config.read_text(), site_config.read_text()
    yield NoDockerUser(place, path, venv, site_config, _make_zoo(place))
    shutil.rmtree(place, ignore_errors=True)


def _wait_until_gone(job_id: str, timeout: float = 180) -> None:
    """Until the job left SLURM's queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        if not queued.stdout.strip():
            return
        time.sleep(1)
    raise AssertionError(f"job {job_id} still queued after {timeout:.0f} s")


def _rank_sessions(job: UserJob) -> set:
    """The session of each rank's ch-run (the run module starts it in a session of its own, named by its pid in the
    node dir's rank-process.json): the rank's whole tree, its orphans too."""
    named = [json.loads(path.read_text()) for path in job.results.glob("*/attempt-0/nodes/*/rank-process.json")]
    return {int(record["pid"]) for record in named}


def _job_processes(job: UserJob, sessions: set) -> list[str]:
    """The job's live processes on the machine (every lab node shares its process table): the user's in a rank's
    session, or whose environment names the job (SLURM_JOB_ID: its steps, modules and srun). The user's other tests'
    processes are not the job's; a zombie awaiting its reaper runs nothing and holds nothing."""
    uid = pwd.getpwnam(NODOCKER).pw_uid
    marker = f"SLURM_JOB_ID={job.job_id}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or proc.stat().st_uid != uid:
                continue
            state, _, _, session = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:4]
            environ = (proc / "environ").read_bytes().split(b"\0")
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if state != "Z" and (int(session) in sessions or marker in environ):
            found.append(f"{proc.name} session {session}: {command}")
    return found


def _after(job: UserJob) -> UserJob:
    """`job` once its collect job left the queue, with the job's processes left then."""
    found = re.search(r"its collect job: (\d+)", job.output)
    if found:
        _wait_until_gone(found.group(1))
    # A step's heartbeat loop (the srun connection's `sleep 3`) ends within its interval of its step's end: what
    # is still there after a grace of several intervals was left behind.
    deadline = time.monotonic() + LEFT_BEHIND_AFTER
    while (left := _job_processes(job, _rank_sessions(job))) and time.monotonic() < deadline:
        time.sleep(1)
    job.processes_left = left
    return job


def _unpacked(node: lab.LabNode, image_id: str) -> Path:
    """Where `node` unpacks the image `image_id` (the lab's charliecloud_unpack_dir, seen from outside the node)."""
    relative = lab.LAB_UNPACK_DIR.replace("%u", NODOCKER).removeprefix(str(lab.NODE_LOCAL_DIR)).strip("/")
    return node.local_dir / relative / image_id.removeprefix("sha256:")


@pytest.fixture(scope="module")
def secret():
    return f"chprobe-{os.urandom(12).hex()}"


@pytest.fixture(scope="module")
def ddp_job(user, secret):
    job = user.submit("ddp", ["-N", "3", "--nodelist", "node[1-3]", "--tags", "ch_ddp_secret"], **{SECRET_NAME: secret})
    return _after(job)


@pytest.fixture(scope="module")
def crash_job(user):
    context = json.dumps({"docker_env_vars": {"PROBE_MODE": "crash"}})
    with hidden([NO_FUSE_NODE], FUSE_DEVICE):
        # Pull mode here and in the hang job, push mode in the others: the runtime in both modes.
        args = ["-N", "3", "--nodelist", "node[1-3]", "--mode", "pull", "--tags", "ch_probe", "-c", context]
        job = user.submit("crash", args)
    return _after(job)


def _tear(unpacked: Path) -> None:
    """An unpack cut short: no completion marker, and the tree lacks its shell."""
    unpacked.with_suffix(".json").unlink()
    (unpacked / "bin" / "busybox").unlink()


@pytest.fixture(scope="module")
def cancel_job(user, crash_job):
    unpacked = _unpacked(NO_FUSE_NODE, crash_job.image_id())
    _tear(unpacked)
    context = json.dumps({"docker_env_vars": {"PROBE_MODE": "wait"}})
    with hidden([NO_FUSE_NODE], FUSE_DEVICE):
        job = user.submit(
            "cancel", ["-N", "3", "--nodelist", "node[1-3]", "--tags", "ch_probe", "-c", context], wait=False
        )
        job_id = job.job_id
        deadline = time.monotonic() + 300
        while not all("waits" in job.log(node) for node in NODES) and time.monotonic() < deadline:
            time.sleep(1)
        job.waited_on_every_node = all("waits" in job.log(node) for node in NODES)
        job.rank_sessions = _rank_sessions(job)
        job.processes_while_waiting = _job_processes(job, job.rank_sessions)
        run_as(NODOCKER, ["scancel", job_id], env=user.environment())
        _wait_until_gone(job_id)
    job.unpacked = unpacked
    return _after(job)


@pytest.fixture(scope="module")
def hang_job(user, ddp_job):
    args = ["-N", "3", "--nodelist", "node[1-3]", "--mode", "pull", "--tags", "ch_hang"]
    args += ["-e", f"hang_timeout={HANG_TIMEOUT}"]
    job = user.submit("hang", args)
    return _after(job)


def _changed_base(user: NoDockerUser) -> Path:
    """The lab's busybox base with one file more: a base whose content changed under the same name."""
    changed = user.place / "busybox-changed.tar"
    shutil.copy(lab.ensure_busybox_tar(), changed)
    marker = user.place / "probe-base"
    marker.write_text("changed\n")
    with tarfile.open(changed, "a") as tar:
        tar.add(marker, arcname="./etc/probe-base")
    changed.chmod(0o644)
    return changed


@pytest.fixture(scope="module")
def preflight_job(user, crash_job):
    settings = user.place / "user-settings.yml"
    bases = {lab.BASE_IMAGE: str(_changed_base(user))}
    settings.write_text(json.dumps({"charliecloud_bases": bases}) + "\n")
    shutil.chown(settings, NODOCKER)
    settings.chmod(0o600)
    context = json.dumps({"docker_env_vars": {"PROBE_MODE": "quick"}})
    args = ["-N", "2", "--nodelist", "node[1-3]", "--preflight", "--tags", "ch_probe", "-c", context]
    with hidden([NO_FUSE_NODE], CH_RUN):
        job = user.submit("preflight", args, SLURM_MULTI_SETTINGS=str(settings))
    return _after(job)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- the PyTorch DDP sample, its launcher contract and its secret --------------------------------------------------


def test_the_pytorch_ddp_sample_trains_across_three_nodes_under_charliecloud(ddp_job):
    job = ddp_job
    assert job.run.returncode == 0, job.output[-4000:]
    record = job.record
    assert record["status"] == "SUCCESS", record["reason"]
    (row,) = record["rows"]
    assert (row["model"], row["metric"], row["launcher"]) == ("ch_ddp_secret", "tokens/sec", "torchrun")
    assert float(row["performance"]) > 0
    for rank, node in enumerate(NODES):
        log = job.log(node)
        assert f"rank {rank}/3 joined" in log and "weights agree across 3 ranks" in log, log[-2000:]
        assert f"rank {rank} runs as {NODOCKER}" in log
        assert job.status(node)["container_runtime"] == "charliecloud"


def test_every_rank_starts_through_mads_launcher_contract(ddp_job):
    for rank, node in enumerate(NODES):
        (line,) = [line for line in ddp_job.log(node).splitlines() if line.startswith(f"rank {rank}/3 on {node}: ")]
        runner = line.split(": ", 1)[1]
        assert runner.startswith("torchrun ") and "--nnodes" in runner and runner.endswith("train_ddp.py --steps 5")


def test_every_node_runs_the_one_squashfs_rank_0_published_and_its_digest_is_the_images_identity(ddp_job):
    image = json.loads((ddp_job.attempt_dir / "image.json").read_text())
    squashfs = Path(image["reference"])
    assert squashfs.suffix == ".sqfs" and squashfs.stem == _sha256(squashfs)
    assert {ddp_job.image_id(node) for node in NODES} == {f"sha256:{squashfs.stem}"}
    assert {entry["image_id"] for entry in ddp_job.record["per_node"].values()} == {f"sha256:{squashfs.stem}"}


def test_the_secret_reaches_every_rank_and_no_output(ddp_job, secret):
    hashed = hashlib.sha256(secret.encode()).hexdigest()
    for node in NODES:
        assert f"secret sha256 {hashed}" in ddp_job.log(node)
    assert secret not in ddp_job.output
    leaked = [path for path in ddp_job.results.rglob("*") if path.is_file() and secret.encode() in path.read_bytes()]
    assert leaked == []


# --- a crash, fail-fast, and a node without FUSE --------------------------------------------------------------------


def test_a_crash_on_one_worker_stops_the_others_and_fails_the_job_naming_it(crash_job):
    job = crash_job
    assert job.run.returncode != 0 and job.record["status"] == "FAILURE", job.output[-3000:]
    assert job.status("node2")["exit_code"] == 3 and "rank 1 crashes" in job.log("node2")
    for node in ("node1", "node3"):
        assert job.status(node)["aborted_by_rank"] == 1, job.status(node)
        assert "waits" in job.log(node) and "done waiting" not in job.log(node)
    assert "node2" in job.record["reason"]


def test_no_process_of_the_user_is_left_after_a_crash(crash_job):
    assert crash_job.processes_left == []


def test_a_node_without_fuse_runs_the_image_unpacked_once_into_its_own_storage(crash_job):
    unpacked = _unpacked(NO_FUSE_NODE, crash_job.image_id())
    assert (unpacked / "bin" / "busybox").is_file() and unpacked.with_suffix(".json").is_file()
    for node in (lab.LabNode(1), lab.LabNode(2)):  # FUSE: run in place, nothing unpacked
        assert not _unpacked(node, crash_job.image_id()).exists()
    assert "rank 2 on node3" in crash_job.log("node3")


# --- scancel, and a torn unpack ----------------------------------------------------------------------------------


def test_scancel_ends_the_job_as_cancelled_and_leaves_no_process(cancel_job):
    job = cancel_job
    assert job.waited_on_every_node, {node: job.log(node)[-500:] for node in NODES}
    # What the count below would find: each rank's session (ch-run, which execs the command of a directory image,
    # and the sleep inside the container), and the job's steps.
    running = job.processes_while_waiting
    sessions = {int(line.split(" session ", 1)[1].split(":", 1)[0]) for line in running}
    assert job.rank_sessions <= sessions and len(job.rank_sessions) == 3, running
    assert sum("sleep 300" in line for line in running) == 3, running
    assert job.processes_left == []
    record = job.record
    assert record["status"] == "FAILURE" and "cancel" in record["reason"].lower(), record["reason"]


def test_a_torn_unpack_is_never_run_the_node_unpacks_the_image_again(cancel_job, crash_job):
    assert cancel_job.image_id("node3") == crash_job.image_id("node3")
    assert "rank 2 waits" in cancel_job.log("node3")  # the torn tree has no shell: it would not have started
    assert (cancel_job.unpacked / "bin" / "busybox").is_file() and cancel_job.unpacked.with_suffix(".json").is_file()


# --- a hang, named with every rank's stacks -------------------------------------------------------------------------


def test_a_hang_is_named_with_every_ranks_stacks(hang_job):
    job = hang_job
    assert job.record["status"] == "FAILURE" and job.record["reason"].startswith("hang"), job.record["reason"]
    for node in NODES:
        assert job.status(node)["hang"] is True
        stacks = (job.attempt_dir / "nodes" / node / "stacks.txt").read_text()
        assert "<module>" in stacks and "python3" in stacks, stacks
    assert job.processes_left == []


# --- preflight leaves out a node without ch-run; a changed base rebuilds the image ---------------------------------


def test_preflight_leaves_out_the_node_without_ch_run_naming_the_fix(preflight_job):
    job = preflight_job
    assert job.run.returncode == 0, job.output[-4000:]
    (left_out,) = [line for line in job.output.splitlines() if "leaving out node3" in line]
    assert "ch-run" in left_out and "install" in left_out.lower(), left_out
    assert sorted(job.record["per_node"]) == ["node1", "node2"]


def test_an_image_whose_base_changed_is_rebuilt_over_the_new_base(preflight_job, crash_job):
    assert preflight_job.image_id() != crash_job.image_id()
    for rank, node in enumerate(("node1", "node2")):
        assert f"rank {rank} on {node} as {NODOCKER}, base changed" in preflight_job.log(node)
    assert "base lab" in crash_job.log("node1")


@pytest.mark.parametrize("job, mode", [("ddp_job", "push"), ("crash_job", "pull"), ("hang_job", "pull")])
def test_the_runtime_runs_in_both_pipeline_modes(request, job, mode):
    in_mode(request.getfixturevalue(job), mode, request.getfixturevalue(job).ansible_output)
