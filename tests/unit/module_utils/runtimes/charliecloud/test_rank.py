"""A node's rank under Charliecloud: real ``ch-run`` on a tiny directory image (static busybox), run by an ordinary
local user in no docker group, as a site without Docker runs it. The run logic runs as that user's own process
(tests/support/users/user_python.py); these tests read its files and /proc from outside."""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import ModelRunError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import by_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.image import MOUNT_POINTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.options import translate
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.rank import (
    format_ch_run_env_file,
    host_gpu_env,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from tests.support.lab.model_runs import MODELS
from tests.support.users.local_users import NODOCKER, ensure_user
from tests.support.users.user_python import run_python_as, start_python_as

pytestmark = pytest.mark.skipif(shutil.which("ch-run") is None, reason="needs Charliecloud's ch-run")

BUSYBOX = "/bin/busybox"
NUL = b"\0"
DIGEST = hashlib.sha256(b"slurm-multi test image").hexdigest()

# The user's process: one rank (or several, in threads) run to its end under Charliecloud; prints each outcome.
DRIVER = r"""
import json, sys, threading
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.cancellation import (
    Cancellation, install_cancel_handlers)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run import run_model_container
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import ModelRun
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import by_name

specs = json.loads(sys.argv[1])
cancellation = Cancellation()
install_cancel_handlers(cancellation)
outcomes = {}
def run(spec):
    outcome = run_model_container(ModelRun(**spec), cancellation, runtime=by_name("charliecloud"))
    outcomes[spec["rank"]] = {"status": outcome.status, "log": outcome.log_path,
                              "diagnostics": outcome.diagnostics_path, "warnings": outcome.warnings}
threads = [threading.Thread(target=run, args=(spec,)) for spec in specs[1:]]
for thread in threads:
    thread.start()
print("started", flush=True)
run(specs[0])
for thread in threads:
    thread.join()
print(json.dumps(outcomes), flush=True)
"""


def _own(path: Path, user) -> None:
    for directory, dirs, files in os.walk(path):
        for name in [directory] + [os.path.join(directory, n) for n in dirs + files]:
            os.lchown(name, user.pw_uid, user.pw_gid)


@pytest.fixture(scope="module")
def nodocker():
    user = ensure_user(NODOCKER, groups=())
    with_docker = [group.gr_name for group in grp.getgrall() if NODOCKER in group.gr_mem and "docker" in group.gr_name]
    assert with_docker == [], f"{NODOCKER} must be in no docker group"
    return user


@pytest.fixture(scope="module")
def image(nodocker):
    """A directory image named by its digest (as the build stage unpacks one): busybox, the host's /usr bound in for
    a python, and the job's mount points; in a dir the user can reach (pytest's own is root's, 0700)."""
    base = Path("/tmp") / f"slurm-multi-ch-images-{uuid.uuid4().hex[:8]}"
    root = base / DIGEST
    for directory in ("bin", "etc", "tmp", "proc", "dev", "sys", "usr", "data", "run_logs", "ch"):
        (root / directory).mkdir(parents=True)
    for point in MOUNT_POINTS:
        (root / point.lstrip("/")).mkdir(parents=True, exist_ok=True)
    shutil.copy(BUSYBOX, root / "bin" / "busybox")
    for tool in ("sh", "ls", "cat", "env", "sleep", "echo", "md5sum", "printf", "nc", "setsid", "ps", "find", "tail"):
        (root / "bin" / tool).symlink_to("busybox")
    (root / "lib").symlink_to("usr/lib")
    (root / "lib64").symlink_to("usr/lib64")
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "ch" / "environment").write_text("IMAGE_SAYS=from-the-image\n")
    # The completion marker the build stage writes beside an unpacked image: what names it.
    (base / f"{DIGEST}.json").write_text(json.dumps({"runtime": "charliecloud", "sha256": DIGEST, "unpacked": True}))
    _own(base, nodocker)
    os.chmod(base, 0o700)
    yield root
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def place(nodocker, tmp_path):
    """A dir of the user's own (0700) with the model's scripts."""
    where = Path("/tmp") / f"slurm-multi-ch-test-{uuid.uuid4().hex[:8]}"
    (where / "model").mkdir(parents=True)
    for name, text in MODELS.items():
        (where / "model" / name).write_text(text)
    _own(where, nodocker)
    os.chmod(where, 0o700)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def spec(place: Path, image: Path, script: str, rank=0, nnodes=1, **overrides) -> dict:
    options = dict(
        job_id="4242",
        rank=rank,
        nnodes=nnodes,
        node=f"node{rank}",
        model="dummy",
        image=str(image),
        model_dir=str(place / "model"),
        script=script,
        results_dir=str(place / "results"),
        master_addr="127.0.0.1",
        master_port=29500,
        user=NODOCKER,
        poll_interval=0.2,
        stop_grace=1,
        diagnostics_budget=10,
        hang_timeout=0,
        environ={},
        docker_env_vars={"TEST_PLACE": str(place)},
    )
    options.update(overrides)
    return options


def write_script(place: Path, name: str, text: str, nodocker) -> None:
    (place / "model" / name).write_text(text)
    os.chown(place / "model" / name, nodocker.pw_uid, nodocker.pw_gid)


def run_ranks(nodocker, *specs, env=None):
    done = run_python_as(NODOCKER, DRIVER, json.dumps(list(specs)), home=nodocker.pw_dir, env=env or {})
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(rank): outcome for rank, outcome in json.loads(done.stdout.splitlines()[-1]).items()}


def rank_processes(nodocker, place: Path):
    """The user's processes of this test's ranks: ch-run naming the test's dir, or a process whose environment says
    it is a rank of this test (the user may run other things meanwhile)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != nodocker.pw_uid:
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(place).encode() in argv and b"ch-run" in argv or f"TEST_PLACE={place}".encode() in environ:
            found.append(f"{pid} {argv.replace(NUL, b' ').decode(errors='replace')}")
    return found


# ------------------------------------------------------------------------------------------------------ the run


def test_a_rank_runs_under_ch_run_as_the_users_own_process_with_its_topology(nodocker, image, place):
    outcome = run_ranks(nodocker, spec(place, image, "perf.sh", rank=1, nnodes=2, master_port=31234))[1]

    status = outcome["status"]
    assert (status["status"], status["exit_code"], status["perf_lines"]) == ("SUCCESS", 0, 1), status
    assert status["container_runtime"] == "charliecloud" and status["image_id"] == f"sha256:{DIGEST}"
    assert "NODE_RANK=1 NNODES=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=31234" in Path(outcome["log"]).read_text()


def test_the_secret_reaches_the_rank_through_a_private_file_never_argv_and_not_the_log(nodocker, image, place):
    token = f"hf_{uuid.uuid4().hex}"
    secrets = place / "secrets.env"
    secrets.write_text(f"MAD_SECRETS_HFTOKEN={token}\n")
    os.chown(secrets, nodocker.pw_uid, nodocker.pw_gid)
    secrets.chmod(0o600)
    write_script(
        place,
        "secret.sh",
        'echo "token=$MAD_SECRETS_HFTOKEN"\nprintf %s "$HF_TOKEN" | md5sum\n'
        'echo "leak=$USER$HOME$LOGNAME image=$IMAGE_SAYS"\nsleep 2\n',
        nodocker,
    )
    the_spec = spec(
        place, image, "secret.sh", secrets_file=str(secrets), docker_env_vars={"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}"}
    )
    driver = start_python_as(NODOCKER, DRIVER, json.dumps([the_spec]), home=nodocker.pw_dir)
    env_files, in_argv = set(), []
    try:
        while driver.poll() is None:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                in_argv += [pid for arg in argv if token.encode() in arg]
            for private in Path("/dev/shm").glob("slurm-multi-env-*/container.env"):
                with contextlib.suppress(OSError):
                    found = private.stat()
                    if found.st_uid == nodocker.pw_uid:
                        env_files.add((str(private), (found.st_mode & 0o777, found.st_uid)))
            time.sleep(0.05)
        out, err = driver.communicate()
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, err[-3000:]
    outcome = json.loads(out.splitlines()[-1])["0"]

    log = Path(outcome["log"]).read_text()
    assert hashlib.md5(token.encode()).hexdigest() in log  # the rank got the real value
    assert "token=********" in log and token not in log
    assert "leak= image=from-the-image" in log  # the host's environment stays out, the image's comes in
    assert in_argv == []
    assert env_files and all(mode == (0o600, nodocker.pw_uid) for _, mode in env_files), env_files
    assert not any(Path(path).exists() for path, _ in env_files)  # removed after the run


def test_context_mounts_are_bound_into_the_rank(nodocker, image, place):
    data = place / "dataset"
    data.mkdir()
    (data / "shard-0001.bin").write_text("x")
    _own(data, nodocker)

    outcome = run_ranks(nodocker, spec(place, image, "list_data.sh", docker_mounts={"/data": str(data)}))[0]

    assert outcome["status"]["status"] == "SUCCESS", outcome
    assert "shard-0001.bin" in Path(outcome["log"]).read_text()


def test_a_bind_whose_destination_the_image_lacks_is_refused_naming_it(nodocker, image, place):
    done = run_python_as(
        NODOCKER,
        DRIVER,
        json.dumps([spec(place, image, "perf.sh", docker_mounts={"/nowhere": str(place)})]),
        home=nodocker.pw_dir,
    )
    assert done.returncode != 0 and "has no /nowhere to bind" in done.stderr


def test_when_one_rank_fails_the_others_stop_with_nothing_left(nodocker, image, place):
    outcomes = run_ranks(
        nodocker,
        spec(place, image, "hang.sh", rank=0, nnodes=2),
        spec(place, image, "fail_later.sh", rank=1, nnodes=2),
    )

    assert outcomes[1]["status"]["exit_code"] == 1
    assert (outcomes[0]["status"]["status"], outcomes[0]["status"]["aborted_by_rank"]) == ("FAILURE", 1)
    diagnostics = Path(outcomes[0]["diagnostics"]).read_text()
    assert "== process tree (from the host)" in diagnostics and "sleep 1000" in diagnostics
    assert rank_processes(nodocker, place) == []


def test_a_hung_rank_at_its_timeout_is_snapshotted_from_the_host_with_its_sockets(nodocker, image, place):
    write_script(place, "listen.sh", "nc -l -p 29577 &\necho 'waiting in allreduce'\nsleep 1000\n", nodocker)

    outcome = run_ranks(nodocker, spec(place, image, "listen.sh", timeout=2))[0]

    assert outcome["status"]["timed_out"] is True
    diagnostics = Path(outcome["diagnostics"]).read_text()
    assert "sleep 1000" in diagnostics and ":29577 pid" in diagnostics
    assert "waiting in allreduce" in diagnostics  # the log's tail
    assert rank_processes(nodocker, place) == []


def test_scancel_stops_the_rank_and_leaves_no_process(nodocker, image, place):
    # A child that left the rank's process group (setsid) is stopped too.
    write_script(place, "daemon.sh", "setsid sleep 1001 &\necho 'up'\nsleep 1000\n", nodocker)
    driver = start_python_as(NODOCKER, DRIVER, json.dumps([spec(place, image, "daemon.sh")]), home=nodocker.pw_dir)
    log = place / "results" / "4242" / "attempt-0" / "nodes" / "node0" / "run.log"
    deadline = time.monotonic() + 30
    while not (log.exists() and "up" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    driver.send_signal(signal.SIGTERM)  # what SLURM sends the step's processes on scancel
    out, err = driver.communicate(timeout=60)

    status = json.loads(out.splitlines()[-1])["0"]["status"]
    assert (status["cancelled"], status["status"]) == (True, "FAILURE"), status
    assert rank_processes(nodocker, place) == []


def test_a_hung_python_rank_is_named_by_the_watchdog_with_its_stacks_from_the_host(nodocker, image, place):
    write_script(
        place,
        "stuck.py",
        "import time\nprint('in the collective', flush=True)\ndef allreduce():\n    time.sleep(1000)\nallreduce()\n",
        nodocker,
    )

    outcome = run_ranks(nodocker, spec(place, image, "stuck.py", docker_mounts={"/usr": "/usr"}, hang_timeout=2))[0]

    assert outcome["status"]["hang"] is True, outcome
    stacks = json.loads((Path(outcome["log"]).parent / "stacks.json").read_text())
    pythons = [process for process in stacks["processes"] if process["python"]]
    assert pythons, stacks
    frames = [frame["function"] for thread in pythons[0]["threads"] for frame in thread["frames"]]
    assert "allreduce" in frames


# ------------------------------------------------------------------------------------------ pieces, no ch-run


def test_docker_options_with_a_meaning_are_translated_and_the_others_refused_by_name():
    translated = translate(
        ["-e", "A=1", "--env=B=2", "-v", "/h:/c", "--workdir", "/w", "--network=host", "--device=/dev/kfd"], {}
    )
    assert translated == ({"A": "1", "B": "2"}, {"/c": "/h"}, "/w")
    with pytest.raises(ModelRunError, match="--memory=4g has no meaning under charliecloud"):
        translate(["--memory=4g"], {})
    with pytest.raises(ModelRunError, match="--network=bridge"):
        translate(["--network=bridge"], {})


def test_the_env_file_keeps_values_literal_under_ch_runs_quote_stripping():
    assert format_ch_run_env_file({"A": "'x'", "B": "$HOME"}) == {"A": "''x''", "B": "'$HOME'"}


def test_the_gpus_are_restricted_by_host_index_since_ch_run_shares_dev():
    assert host_gpu_env("AMD", [2, 3]) == {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "0,1"}
    assert host_gpu_env("NVIDIA", [5]) == {"CUDA_VISIBLE_DEVICES": "5"}


def test_an_unknown_runtime_is_refused_naming_the_choices():
    with pytest.raises(UserError, match="choose one of docker, charliecloud"):
        by_name("podman")


def test_the_nodocker_user_is_no_member_of_a_docker_group(nodocker):
    assert not any(g.gr_name.startswith("docker") and NODOCKER in g.gr_mem for g in grp.getgrall())
    assert pwd.getpwnam(NODOCKER).pw_uid != 0


def test_a_rank_that_scancels_sigterm_reaches_before_the_module_is_recorded_cancelled(nodocker, image, place):
    # The rank is one of the step's processes: SLURM's SIGTERM may end it a moment before the module learns of it.
    write_script(place, "wait.sh", "echo 'up'\nexec sleep 1000\n", nodocker)
    driver = start_python_as(NODOCKER, DRIVER, json.dumps([spec(place, image, "wait.sh")]), home=nodocker.pw_dir)
    log = place / "results" / "4242" / "attempt-0" / "nodes" / "node0" / "run.log"
    deadline = time.monotonic() + 30
    while not (log.exists() and "up" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for line in rank_processes(nodocker, place):
        if "sleep 1000" in line:
            os.kill(int(line.split()[0]), signal.SIGTERM)
    time.sleep(0.3)
    driver.send_signal(signal.SIGTERM)
    out, err = driver.communicate(timeout=60)

    status = json.loads(out.splitlines()[-1])["0"]["status"]
    assert (status["cancelled"], status["status"]) == (True, "FAILURE"), status
