"""The lab cluster: a real multi-node SLURM cluster with one Docker daemon per node, on this one machine (docs/lab.md).

Every node runs in its own UTS + mount namespace with its own loopback address and slurmd port; the state lives in
one machine-wide place (``LAB_DIR``). Every daemon's pid is kept in a file and checked before it is trusted; ``down``
stops exactly those pids. Two Docker registries run beside it for registry mode, the second asking for a login.
"""

import contextlib
import fcntl
import grp
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from secrets import token_urlsafe

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import settings_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.paths import write_new_private_file

LAB_DIR = Path(os.environ.get("SLURM_MULTI_LAB_DIR", "/var/lib/slurm-multi-lab"))
SITE_CONFIG = Path(settings_files.SITE_CONFIG)
HOSTS_FILE = Path("/etc/hosts")
SLURM_CONF = Path("/etc/slurm/slurm.conf")
HOSTS_BEGIN = "# slurm-multi lab: begin"
HOSTS_END = "# slurm-multi lab: end"
SITE_MARKER = "# written by `slurm-multi lab up`; removed by `slurm-multi lab down`"
# The lab's image cache (its site config's image_cache_dir), one per user (%u).
LAB_IMAGE_CACHE_DIR = "/tmp/slurm-multi-image-cache-%u"
SLURMCTLD_PORT = 6817
# The sample models' base image (MAD's BASE_DOCKER): busybox-static FROM scratch, built offline on every node.
BASE_IMAGE = "slurm-multi-lab/busybox:latest"
# The bases as root filesystem tars, for a runtime with no daemon (Charliecloud's `ch-image import`): the busybox one
# made by `up`, the PyTorch one by `slurm-multi lab pytorch-base` (slurm_multi/lab/pytorch.py).
BASES_DIR = LAB_DIR / "bases"
BUSYBOX_BASE_TAR = BASES_DIR / "busybox.tar"
PYTORCH_BASE = "slurm-multi-lab/pytorch:2.13.0"
PYTORCH_BASE_TAR = BASES_DIR / "pytorch-2.13.0-bookworm.tar"
# Each node's own storage (a cluster's node-local disk): one path on every node, inside each node's mount namespace
# a folder of its own bound over it (LabNode.local_dir); outside the nodes an empty folder only root may write.
NODE_LOCAL_DIR = LAB_DIR / "node-local"
# Where a node unpacks a squashfs image it cannot mount (the no-Docker runtime's fallback): node-local, per user.
LAB_UNPACK_DIR = f"{NODE_LOCAL_DIR}/slurm-multi-%u/images"
MAX_NODES = 8
# Registry mode's registry: plain HTTP on loopback, which Docker accepts without TLS and every node's dockerd reaches.
REGISTRY_ADDRESS = "127.0.0.1"
REGISTRY_PORT = 17500
# The registry that needs `docker login` (registry credentials); its lab user.
AUTH_REGISTRY_PORT = 17501
AUTH_REGISTRY_USER = "lab"
# Members of this group may use every node's Docker daemon (root:docker 0660), as the tests' ordinary users do.
DOCKER_GROUP = "docker"
# apache2-utils: htpasswd, for a registry that asks for a login. charliecloud (ch-run, ch-image), python3-lark (the
# parser ch-image imports), squashfs-tools (mksquashfs, unsquashfs) and squashfuse: the runtime with no daemon.
DEBIAN_PACKAGES = [
    "docker.io", "slurmctld", "slurmd", "slurm-client", "munge", "busybox-static", "iptables", "docker-registry",
    "apache2-utils", "charliecloud", "python3-lark", "squashfs-tools", "squashfuse",
]  # fmt: skip
REQUIRED_COMMANDS = [
    "dockerd", "docker", "slurmctld", "slurmd", "sinfo", "munged", "unshare", "nsenter", "busybox", "iptables",
    "docker-registry", "htpasswd", "ch-run", "ch-image", "ch-checkns", "mksquashfs", "unsquashfs", "squashfuse",
]  # fmt: skip
# ch-image runs on Debian's python3 (`#!/usr/bin/env python3`, with /usr/bin first on PATH) and imports lark there.
SYSTEM_PYTHON = "/usr/bin/python3"
REQUIRED_SYSTEM_PYTHON_MODULES = {"lark": "python3-lark"}


class LabError(UserError):
    """The lab could not be brought to the asked state; the message says why and what to do."""


@dataclass(frozen=True)
class LabNode:
    """One emulated node: its name, loopback address and slurmd port."""

    index: int

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def address(self) -> str:
        return f"127.0.0.{10 + self.index}"

    @property
    def port(self) -> int:
        return 17000 + self.index

    @property
    def dir(self) -> Path:
        return LAB_DIR / "nodes" / self.name

    @property
    def docker_socket(self) -> Path:
        return self.dir / "docker.sock"

    @property
    def local_dir(self) -> Path:
        """The folder the node sees at NODE_LOCAL_DIR."""
        return self.dir / "local"


def docker_env(node: LabNode) -> dict[str, str]:
    """This environment, with the docker CLI talking to the node's daemon."""
    return dict(os.environ, DOCKER_HOST=f"unix://{node.docker_socket}")


def lab_nodes(count: int) -> list[LabNode]:
    if not 1 <= count <= MAX_NODES:
        raise LabError(f"--nodes must be between 1 and {MAX_NODES} (got {count}): node addresses are 127.0.0.11-18")
    return [LabNode(i) for i in range(1, count + 1)]


def _pid_file(name: str) -> Path:
    return LAB_DIR / "pids" / f"{name}.pid"


def running_pid(name: str, must_contain: str) -> int | None:
    """The pid recorded for daemon `name` when it is alive and its command line contains `must_contain` (a pid
    file outlives its process, whose pid may since belong to another program)."""
    try:
        pid = int(_pid_file(name).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, ValueError):
        return None
    return pid if any(must_contain in part for part in cmdline) and not _has_exited(pid) else None


def _start(name: str, argv: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    _pid_file(name).parent.mkdir(parents=True, exist_ok=True)
    _pid_file(name).write_text(f"{proc.pid}\n")
    return proc.pid


def _stop(name: str, must_contain: str, timeout: float = 30.0) -> bool:
    pid = running_pid(name, must_contain)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        # Until the process is gone (its cmdline reads empty while it exits: running_pid() no longer names it).
        deadline = time.monotonic() + timeout
        while not _has_exited(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _has_exited(pid):
            os.kill(pid, signal.SIGKILL)
    _pid_file(name).unlink(missing_ok=True)
    return pid is not None


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _has_exited(pid: int) -> bool:
    """Whether a process we just started is gone (or a zombie); not by its command line, which reads empty while it
    execs."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _wait_for(predicate, timeout: float, what: str, log: Path, pid: int) -> None:
    """Wait until `predicate()` holds for the daemon `what` we started as `pid`; LabError if it dies or is slow."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if _has_exited(pid):
            raise LabError(f"{what} exited while starting; last lines of {log}:\n{_log_tail(log)}")
        time.sleep(0.2)
    raise LabError(f"{what} did not become ready within {timeout:.0f}s; last lines of {log}:\n{_log_tail(log)}")


def _port_in_use(address: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return True
    return False


def _require_free_port(address: str, port: int, daemon: str) -> None:
    if _port_in_use(address, port):
        raise LabError(
            f"port {address}:{port} needed by {daemon} is taken by another process "
            f"(see `ss -ltnp 'sport = :{port}'`); stop it, or run `slurm-multi lab down` if it is an old lab"
        )


def _missing_python_modules() -> list[str]:
    """The modules of REQUIRED_SYSTEM_PYTHON_MODULES that Debian's python3 cannot import."""
    return [
        module
        for module in REQUIRED_SYSTEM_PYTHON_MODULES
        if subprocess.run([SYSTEM_PYTHON, "-c", f"import {module}"], capture_output=True).returncode != 0
    ]


def ensure_packages(progress=print) -> None:
    """Install the Debian packages the lab needs when any command (or a module of Debian's python3) is missing."""
    missing = [cmd for cmd in REQUIRED_COMMANDS if shutil.which(cmd) is None]
    missing += [f"{SYSTEM_PYTHON}'s {module}" for module in _missing_python_modules()]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise LabError(f"missing commands {missing} and no apt-get to install them: install {DEBIAN_PACKAGES}")
    progress(f"installing Debian packages ({', '.join(DEBIAN_PACKAGES)}) for: {', '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *DEBIAN_PACKAGES]):
        result = subprocess.run(argv, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise LabError(f"`{' '.join(argv)}` failed:\n{result.stdout[-1500:]}{result.stderr[-1500:]}")


def slurm_conf() -> str:
    """slurm.conf for the lab: no cgroups and no systemd, one slurmd per node on its own address and port. It names
    every node the lab can have, so `up --nodes N` grows a running lab without restarting SLURM; node1-3 weigh
    least, so a 3-node job lands on them."""
    cpus = os.cpu_count() or 2
    node_lines = "\n".join(
        f"NodeName={n.name} NodeAddr={n.address} NodeHostname={n.name} Port={n.port} CPUs={cpus} RealMemory=2000"
        f" Weight={max(n.index, 3)}"
        for n in lab_nodes(MAX_NODES)
    )
    names = f"node[1-{MAX_NODES}]"
    state = LAB_DIR / "slurm"
    return f"""# slurm-multi lab cluster (written by `slurm-multi lab up`)
ClusterName=lab
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={SLURMCTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={LAB_DIR}/logs/slurmctld.log
SlurmdLogFile={LAB_DIR}/logs/slurmd-%n.log
# A job step's credential lives cred_expire seconds (default 120), and a requeued job waits that long plus one
# before it may start again: on one machine a step launches within a second or two, so 20 s is ample.
AuthInfo=cred_expire=20
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=30
MinJobAge=600
InactiveLimit=0
{node_lines}
PartitionName=lab Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


def _write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    safe_files.write_file_atomically(str(path), text.encode("utf-8"), 0o644)
    return True


def _without_lab_hosts(text: str) -> str:
    out, skipping = [], False
    for line in text.splitlines():
        if line.strip() == HOSTS_BEGIN:
            skipping = True
        elif line.strip() == HOSTS_END:
            skipping = False
        elif not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


def _write_hosts(nodes: list[LabNode]) -> None:
    # /etc/hosts may be a bind mount (containers): rewrite it in place, never replace the file.
    base = _without_lab_hosts(HOSTS_FILE.read_text())
    block = "\n".join([HOSTS_BEGIN, *[f"{n.address} {n.name}" for n in nodes], HOSTS_END])
    new = base + block + "\n"
    if HOSTS_FILE.read_text() != new:
        HOSTS_FILE.write_text(new)


def _site_config(nodes: list[LabNode]) -> str:
    # The lab's node names resolve to loopback, which the inventory refuses: the site config names their addresses.
    lines = [SITE_MARKER, "node_addresses:"] + [f"  {n.name}: {n.address}" for n in nodes]
    # Its nodes share /tmp: one image cache per user there serves every lab job, whatever its results dir.
    lines += ["settings:", f"  image_cache_dir: {LAB_IMAGE_CACHE_DIR}"]
    return "\n".join(lines + _charliecloud_settings()) + "\n"


def _charliecloud_settings() -> list[str]:
    """The runtime with no daemon's settings: the lab's bases by the names MAD's BASE_DOCKER gives them, and the
    unpack fallback in node-local storage (/var/tmp is one folder for every lab node)."""
    bases = {BASE_IMAGE: BUSYBOX_BASE_TAR, PYTORCH_BASE: PYTORCH_BASE_TAR}
    lines = ["  charliecloud_bases:"] + [f"    {json.dumps(name)}: {tar}" for name, tar in bases.items()]
    return lines + [f"  charliecloud_unpack_dir: {LAB_UNPACK_DIR}"]


def _munge_answers() -> bool:
    return subprocess.run(["munge", "-n"], capture_output=True).returncode == 0


def _start_munged(progress) -> None:
    if running_pid("munged", "munged"):
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["mungekey", "--create"], check=True)
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    # A munged left over from elsewhere holds the socket: use it rather than fight over it.
    if Path("/run/munge/munge.socket.2").exists() and _munge_answers():
        progress("munged: using the one already running")
        return
    progress("starting munged")
    log = LAB_DIR / "logs" / "munged.log"
    # setpriv execs munged itself (no forking wrapper), so the recorded pid is the daemon's.
    munged = ["setpriv", "--reuid", "munge", "--regid", "munge", "--init-groups", "/usr/sbin/munged", "-F"]
    _wait_for(_munge_answers, 20, "munged", log, _start("munged", munged, log))


def registry_config(storage: Path, address: str, port: int, htpasswd: Path | None = None) -> str:
    """The lab registry's config: its blobs under `storage`, listening on `address:port` only, no TLS; with
    `htpasswd`, every request needs a login of that file (basic auth: plain HTTP is fine on loopback)."""
    auth = f"auth:\n  htpasswd:\n    realm: slurm-multi-lab\n    path: {htpasswd}\n" if htpasswd else ""
    return f"""# slurm-multi lab registry (written by `slurm-multi lab up`)
version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: {address}:{port}
{auth}"""


def registry_answers(address: str, port: int, login: bool = False) -> bool:
    """Whether a Docker registry answers its API root on `address:port`: `GET /v2/` -> 200, or with `login` 401
    asking for basic auth (one that answers without a login is not the registry that needs it)."""
    # No proxy: a proxy from the environment must not see (or answer for) a loopback registry.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{address}:{port}/v2/", timeout=2) as response:
            return response.status == 200 and not login
    except urllib.error.HTTPError as error:
        return login and error.code == 401 and "basic" in (error.headers.get("WWW-Authenticate") or "").lower()
    except (urllib.error.URLError, OSError):
        return False


def auth_registry_url() -> str:
    """The lab registry that needs a login, as `--registry` takes it (`127.0.0.1:17501`)."""
    return f"{REGISTRY_ADDRESS}:{AUTH_REGISTRY_PORT}"


def auth_registry_credentials_file() -> Path:
    """The 0600 credential.json (MAD's format) holding the lab user and password of `auth_registry_url`."""
    return LAB_DIR / "auth-registry" / "credential.json"


def _auth_registry_password() -> str:
    """The lab user's password: the one recorded in `auth_registry_credentials_file`, else a new random one."""
    path = auth_registry_credentials_file()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return json.loads(path.read_text())[auth_registry_url()]["password"]
    password = token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    entry = {"username": AUTH_REGISTRY_USER, "password": password}
    write_new_private_file(path, json.dumps({auth_registry_url(): entry}, indent=2) + "\n")
    return password


def _write_htpasswd(path: Path, password: str) -> None:
    """The registry's htpasswd file (bcrypt, as docker-registry requires); the password reaches htpasswd on stdin."""
    htpasswd = ["htpasswd", "-B", "-i", "-c", str(path), AUTH_REGISTRY_USER]
    result = subprocess.run(htpasswd, input=password, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise LabError(f"htpasswd could not write {path} (exit {result.returncode}): {result.stderr.strip()}")
    os.chmod(path, 0o600)


def registry_url() -> str:
    """The lab registry as `--registry` takes it (`127.0.0.1:17500`); add a namespace: `127.0.0.1:17500/ns`."""
    return f"{REGISTRY_ADDRESS}:{REGISTRY_PORT}"


def _start_registry(progress, login: bool = False) -> None:
    """Start the lab registry (with `login`: the one that asks for a login) unless it runs and answers."""
    name = "auth-registry" if login else "registry"
    port = AUTH_REGISTRY_PORT if login else REGISTRY_PORT
    what = "the lab registry with a login" if login else "the lab registry"
    # Its command line names its config: how the process of its pid file is told for ours.
    config = LAB_DIR / name / "config.yml"
    if running_pid(name, str(config)) and registry_answers(REGISTRY_ADDRESS, port, login):
        return
    _stop(name, str(config))
    _require_free_port(REGISTRY_ADDRESS, port, what)
    progress(f"starting {what} on {REGISTRY_ADDRESS}:{port}")
    htpasswd = LAB_DIR / name / "htpasswd" if login else None
    if htpasswd:
        _write_htpasswd(htpasswd, _auth_registry_password())
    _write_if_changed(config, registry_config(LAB_DIR / name / "storage", REGISTRY_ADDRESS, port, htpasswd))
    log = LAB_DIR / "logs" / f"{name}.log"
    pid = _start(name, ["/usr/bin/docker-registry", "serve", str(config)], log)
    _wait_for(lambda: registry_answers(REGISTRY_ADDRESS, port, login), 30, what, log, pid)


def _start_slurmctld(progress) -> bool:
    """Start slurmctld unless it runs; True when it was started here."""
    if running_pid("slurmctld", "slurmctld"):
        return False
    _require_free_port("127.0.0.1", SLURMCTLD_PORT, "slurmctld")
    progress("starting slurmctld")
    (LAB_DIR / "slurm" / "ctld").mkdir(parents=True, exist_ok=True)
    pid = _start("slurmctld", ["/usr/sbin/slurmctld", "-D", "-i"], LAB_DIR / "logs" / "slurmctld.out")

    def answers() -> bool:
        return "UP" in subprocess.run(["scontrol", "ping"], capture_output=True, text=True).stdout

    _wait_for(answers, 30, "slurmctld", LAB_DIR / "logs" / "slurmctld.log", pid)
    return True


def _cancel_earlier_jobs(progress) -> None:
    """Cancel the jobs slurmctld restored from the lab's earlier life, which would hold their nodes for good; not
    cleared (`slurmctld -c`), so job IDs go on counting and no results dir is reused."""
    listed = subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, check=True)
    jobs = listed.stdout.split()
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, text=True, check=True)
        progress(f"cancelled {len(jobs)} job(s) of the lab's earlier life: {' '.join(jobs)}")


def _in_node(holder_pid: int, argv: list[str]) -> list[str]:
    return ["nsenter", "-t", str(holder_pid), "-u", "-m", *argv]


def _holder_ok(node: LabNode) -> int | None:
    pid = running_pid(f"{node.name}-holder", "sleep")
    if pid is None:
        return None
    try:
        name = subprocess.run(_in_node(pid, ["hostname"]), capture_output=True, text=True, timeout=5).stdout.strip()
    except subprocess.TimeoutExpired:
        return None
    return pid if name == node.name else None


def _docker_ok(node: LabNode) -> bool:
    version = ["docker", "version", "--format", "{{.Server.Version}}"]
    return subprocess.run(version, env=docker_env(node), capture_output=True).returncode == 0


def _ensure_base_image(node: LabNode, progress) -> None:
    env = dict(docker_env(node), DOCKER_BUILDKIT="0")
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], env=env, capture_output=True).returncode == 0:
        return
    progress(f"{node.name}: building the base image {BASE_IMAGE}")
    context = node.dir / "base-image"
    context.mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", context / "busybox")
    (context / "Dockerfile").write_text(
        'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "--install", "-s", "/bin"]\n'
        'RUN mkdir -p /tmp /root && chmod 1777 /tmp\nCMD ["/bin/sh"]\n'
    )
    build = ["docker", "build", "-q", "--network=host", "-t", BASE_IMAGE, str(context)]
    result = subprocess.run(build, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"{node.name}: building {BASE_IMAGE} failed:\n{result.stderr[-1500:]}")


def ensure_busybox_tar() -> Path:
    """BUSYBOX_BASE_TAR, made unless it is there: BASE_IMAGE's tree (busybox and its applets) as a root filesystem tar,
    with the files and folders `ch-run` binds over (the host's /etc/passwd and /etc/group, /tmp, /dev, ...): a
    squashfs image is read-only, so a bind's destination must exist in it."""
    if BUSYBOX_BASE_TAR.is_file():
        return BUSYBOX_BASE_TAR
    BASES_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BASES_DIR, prefix=".busybox-") as work:
        root = Path(work) / "root"
        for folder in ("bin", "etc", "tmp", "root", "dev", "proc", "sys", "home", "mnt", "run", "var/tmp"):
            (root / folder).mkdir(parents=True)
        for name in ("passwd", "group", "hosts", "resolv.conf"):
            (root / "etc" / name).touch()
        shutil.copy("/bin/busybox", root / "bin" / "busybox")
        applets = subprocess.run(["busybox", "--list"], capture_output=True, text=True, check=True).stdout.split()
        for applet in applets:
            if applet != "busybox":
                (root / "bin" / applet).symlink_to("busybox")
        for folder in ("tmp", "var/tmp"):
            (root / folder).chmod(0o1777)
        partial = Path(work) / "busybox.tar"
        tar = ["tar", "-C", str(root), "--numeric-owner", "--owner=0", "--group=0", "-cf", str(partial), "."]
        subprocess.run(tar, check=True, capture_output=True)
        partial.chmod(0o644)
        os.replace(partial, BUSYBOX_BASE_TAR)  # whole or absent
    return BUSYBOX_BASE_TAR


def _ensure_docker_group() -> None:
    """Make the group whose members may use the nodes' Docker sockets, before any dockerd starts."""
    try:
        grp.getgrnam(DOCKER_GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", DOCKER_GROUP], check=True, capture_output=True)


def _share_docker_socket(node: LabNode) -> None:
    """The node's socket root:docker 0660: a daemon started before the group existed made it root's alone."""
    gid = grp.getgrnam(DOCKER_GROUP).gr_gid
    found = node.docker_socket.stat()
    if found.st_gid != gid:
        os.chown(node.docker_socket, 0, gid)
    if stat.S_IMODE(found.st_mode) != 0o660:
        os.chmod(node.docker_socket, 0o660)


def _bind_docker_socket(node: LabNode, holder: int) -> None:
    # A restarted dockerd makes a new socket file while the bind mount shows the old one: compare inodes.
    seen = subprocess.run(
        _in_node(holder, ["stat", "-L", "-c", "%i", "/run/docker.sock"]), capture_output=True, text=True
    ).stdout.strip()
    if seen == str(node.docker_socket.stat().st_ino):
        return
    if not Path("/run/docker.sock").exists():
        Path("/run/docker.sock").touch()  # a bind mount needs a target
    # Unmount every stale layer (a dead socket cannot be bound over), then bind the live one.
    while subprocess.run(_in_node(holder, ["umount", "-l", "/run/docker.sock"]), capture_output=True).returncode == 0:
        pass
    bind = ["mount", "--bind", str(node.docker_socket), "/run/docker.sock"]
    result = subprocess.run(_in_node(holder, bind), capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"{node.name}: cannot bind its Docker socket over /run/docker.sock: {result.stderr.strip()}")


def _bind_node_local_dir(node: LabNode, holder: int) -> None:
    """The node's own folder over NODE_LOCAL_DIR inside its mount namespace (1777, as /var/tmp)."""
    node.local_dir.mkdir(parents=True, exist_ok=True)
    node.local_dir.chmod(0o1777)
    NODE_LOCAL_DIR.mkdir(parents=True, exist_ok=True)
    NODE_LOCAL_DIR.chmod(0o755)
    seen = subprocess.run(
        _in_node(holder, ["stat", "-c", "%i", str(NODE_LOCAL_DIR)]), capture_output=True, text=True
    ).stdout.strip()
    if seen == str(node.local_dir.stat().st_ino):
        return
    bind = ["mount", "--bind", str(node.local_dir), str(NODE_LOCAL_DIR)]
    result = subprocess.run(_in_node(holder, bind), capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"{node.name}: cannot bind its node-local folder over {NODE_LOCAL_DIR}: {result.stderr.strip()}")


def _start_node(node: LabNode, progress) -> None:
    holder = _holder_ok(node)
    if holder is None:
        # A node whose namespace holder is gone cannot be repaired in place: restart all of its daemons.
        _stop(f"{node.name}-slurmd", "slurmd")
        _stop(f"{node.name}-dockerd", "dockerd")
        progress(f"{node.name}: creating its namespaces (hostname, mounts)")
        node.dir.mkdir(parents=True, exist_ok=True)
        script = f"hostname {node.name} && mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm && exec sleep infinity"
        log = LAB_DIR / "logs" / f"{node.name}-holder.log"
        unshare = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script]
        _start(f"{node.name}-holder", unshare, log)
        deadline = time.monotonic() + 10
        while holder is None and time.monotonic() < deadline:
            time.sleep(0.1)
            holder = _holder_ok(node)
        if holder is None:
            raise LabError(f"{node.name}: its namespace holder did not start; see {log}:\n{_log_tail(log)}")

    if not running_pid(f"{node.name}-dockerd", "dockerd") or not _docker_ok(node):
        _stop(f"{node.name}-dockerd", "dockerd")
        # Ours is not running: a pid file left by a machine's restart names a pid another process may hold now, and
        # dockerd would refuse to start beside it.
        (node.dir / "docker.pid").unlink(missing_ok=True)
        progress(f"{node.name}: starting its Docker daemon")
        log = LAB_DIR / "logs" / f"{node.name}-dockerd.log"
        dockerd = [
            "dockerd",
            "--data-root", str(node.dir / "docker"),
            "--exec-root", str(node.dir / "exec"),
            "--pidfile", str(node.dir / "docker.pid"),
            "-H", f"unix://{node.docker_socket}",
            "--group", DOCKER_GROUP,
            "--bridge=none", "--iptables=false", "--ip-masq=false",
        ]  # fmt: skip
        pid = _start(f"{node.name}-dockerd", _in_node(holder, dockerd), log)
        _wait_for(lambda: _docker_ok(node), 60, f"{node.name}'s dockerd", log, pid)

    _share_docker_socket(node)
    _ensure_base_image(node, progress)

    # Inside the node, the default Docker socket is the node's own daemon, as on a real cluster.
    _bind_docker_socket(node, holder)
    _bind_node_local_dir(node, holder)

    if not running_pid(f"{node.name}-slurmd", "slurmd"):
        _require_free_port(node.address, node.port, f"{node.name}'s slurmd")
        progress(f"{node.name}: starting slurmd on {node.address}:{node.port}")
        (LAB_DIR / "slurm" / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        _start(
            f"{node.name}-slurmd",
            _in_node(holder, ["/usr/sbin/slurmd", "-D", "-N", node.name]),
            LAB_DIR / "logs" / f"{node.name}-slurmd.out",
        )


def _node_states() -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout
    return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)


def _wait_nodes_idle(nodes: list[LabNode], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    resumed = False
    while time.monotonic() < deadline:
        states = _node_states()
        if all(states.get(n.name, "").rstrip("*") in ("idle", "mix", "alloc") for n in nodes):
            return
        # A node marked down by an earlier lab (its slurmd vanished) needs telling that it is back.
        down = [n.name for n in nodes if states.get(n.name, "").rstrip("*") in ("down", "drain", "drng", "fail")]
        if down and not resumed:
            subprocess.run(["scontrol", "update", f"nodename={','.join(down)}", "state=resume"], capture_output=True)
            resumed = True
        time.sleep(0.5)
    tails = "\n".join(f"--- {n.name}:\n{_log_tail(LAB_DIR / 'logs' / f'slurmd-{n.name}.log', 5)}" for n in nodes)
    raise LabError(f"nodes not idle within {timeout:.0f}s: {_node_states()}\n{tails}")


def _require_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab cluster needs root (it starts slurmd, dockerd and namespaces): run it as root")


def _recorded_node_count() -> int | None:
    try:
        return int(json.loads((LAB_DIR / "lab.json").read_text())["nodes"])
    except (OSError, ValueError, KeyError):
        return None


@contextlib.contextmanager
def _one_at_a_time():
    """Held while `up` or `down` runs, so two callers take turns (a lock file beside the lab's dir)."""
    LAB_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(LAB_DIR.parent / f".{LAB_DIR.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def up(node_count: int = 3, progress=print) -> list[LabNode]:
    """Bring the lab up with at least `node_count` nodes, or repair a half-started one; idempotent. A running lab
    grows but never shrinks (only `down` does)."""
    _require_root()
    with _one_at_a_time():
        lab_nodes(node_count)  # checks the count before anything starts
        if running_pid("slurmctld", "slurmctld"):
            node_count = max(node_count, _recorded_node_count() or 0)
        nodes = lab_nodes(node_count)
        ensure_packages(progress)
        for sub in ("pids", "logs", "nodes", "slurm"):
            (LAB_DIR / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(LAB_DIR, 0o755)
        conf_changed = _write_if_changed(SLURM_CONF, slurm_conf())
        if conf_changed and running_pid("slurmctld", "slurmctld"):
            for node in lab_nodes(MAX_NODES):
                _stop(f"{node.name}-slurmd", "slurmd")
            _stop("slurmctld", "slurmctld")
        _write_hosts(nodes)
        _write_if_changed(SITE_CONFIG, _site_config(nodes))
        (LAB_DIR / "lab.json").write_text(json.dumps({"nodes": node_count}) + "\n")
        _start_munged(progress)
        _ensure_docker_group()
        ensure_busybox_tar()
        if _start_slurmctld(progress):
            _cancel_earlier_jobs(progress)
        for node in nodes:
            _undrop_address(node.address)
            _start_node(node, progress)
        _wait_nodes_idle(nodes)
        _start_registry(progress)
        _start_registry(progress, login=True)
        progress(
            f"lab up: {', '.join(n.name for n in nodes)} idle; registry on {registry_url()}, one with a login on "
            f"{auth_registry_url()} (credentials: {auth_registry_credentials_file()})"
        )
        return nodes


def _undrop_address(address: str) -> None:
    """Delete the dead-node fault's rule dropping a node's packets (tests/faults), left by a killed test."""
    rule = ["INPUT", "-d", f"{address}/32", "-j", "DROP"]
    while shutil.which("iptables") and subprocess.run(["iptables", "-C", *rule], capture_output=True).returncode == 0:
        subprocess.run(["iptables", "-D", *rule], capture_output=True, check=True)


def down(progress=print) -> None:
    """Stop exactly the daemons `up` started (by their pid files) and undo what it added to /etc."""
    _require_root()
    with _one_at_a_time():
        nodes = lab_nodes(MAX_NODES)
        for node in nodes:
            if _stop(f"{node.name}-slurmd", "slurmd"):
                progress(f"{node.name}: slurmd stopped")
        for node in nodes:
            if _stop(f"{node.name}-dockerd", "dockerd", timeout=40):
                progress(f"{node.name}: dockerd stopped")
            # The node's mounts live in its own mount namespace: they vanish with its last process, the holder.
            if _stop(f"{node.name}-holder", "sleep"):
                progress(f"{node.name}: namespaces released")
        if _stop("slurmctld", "slurmctld"):
            progress("slurmctld stopped")
        if _stop("munged", "munged"):
            progress("munged stopped")
        if _stop("registry", str(LAB_DIR / "registry" / "config.yml")):
            progress("registry stopped")
        if _stop("auth-registry", str(LAB_DIR / "auth-registry" / "config.yml")):
            progress("registry with a login stopped")
        if HOSTS_FILE.exists():
            text = HOSTS_FILE.read_text()
            if HOSTS_BEGIN in text:
                HOSTS_FILE.write_text(_without_lab_hosts(text))
        if SITE_CONFIG.exists() and SITE_MARKER in SITE_CONFIG.read_text():
            SITE_CONFIG.unlink()
        (LAB_DIR / "lab.json").unlink(missing_ok=True)
        progress("lab down")


def daemon_states(node_count: int | None = None) -> dict[str, int | None]:
    """Each lab daemon's pid, or None when it is not running."""
    count = node_count or _recorded_node_count() or 3
    states = {
        "munged": running_pid("munged", "munged"),
        "slurmctld": running_pid("slurmctld", "slurmctld"),
        "registry": running_pid("registry", str(LAB_DIR / "registry" / "config.yml")),
        "auth-registry": running_pid("auth-registry", str(LAB_DIR / "auth-registry" / "config.yml")),
    }
    for node in lab_nodes(count):
        for daemon, needle in (("holder", "sleep"), ("dockerd", "dockerd"), ("slurmd", "slurmd")):
            states[f"{node.name}-{daemon}"] = running_pid(f"{node.name}-{daemon}", needle)
    return states


def status(out=sys.stdout) -> bool:
    """Print sinfo and each daemon's state; True when everything runs."""
    states = daemon_states()
    for name, pid in states.items():
        print(f"{name:<16} {'running, pid ' + str(pid) if pid else 'stopped'}", file=out)
    if shutil.which("sinfo") and states.get("slurmctld"):
        result = subprocess.run(["sinfo"], capture_output=True, text=True)
        print(result.stdout.rstrip() or result.stderr.rstrip(), file=out)
    return all(states.values())
