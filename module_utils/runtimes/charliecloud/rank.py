"""A rank under Charliecloud: ``ch-run`` as this module's own child in its own process group, no daemon, the user's
own processes (docs/no-docker.md, "Running a rank"). Its environment goes through a private 0600 file (never argv,
never the step's environment) over an emptied host environment; its output into the node's run.log, secrets masked;
stop, cancel and fail-fast signal its process group; diagnostics and stacks are read from the host."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.devices import allocated_gpu_indices
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import container_env_file, mask_secrets
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run import process_tree
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_command import command_lines
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_log import (
    copy_log_in_background,
    write_log_head,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_runtime import (
    ContainerRuntime,
    LogDrain,
    Rank,
    RankWatch,
    sleep_until_exit,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.diagnostics import (
    DEFAULT_LOG_DIRS,
    DEFAULT_TAIL_LINES,
    write_diagnostics,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.stacks import take_container_stacks
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.watch import process_activity
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import LAUNCHER_FILES_DIR
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    WORKSPACE,
    ModelRunError,
    card_gpu_indices,
    model_command,
    run_launcher_environment,
    run_tools,
    split_options,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import PYSPY_TOOL, RUN_DIRECTORY
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.builder import (
    charliecloud_builder,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.checks import (
    charliecloud_checks,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.image import (
    MOUNT_POINTS,
    image_identity,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.options import translate

CH_RUN = "ch-run"
# The file beside an image (`<hex>.sqfs` -> `<hex>.json`) that commits it; its name is its identity.
_HEX = re.compile(r"^[0-9a-f]{64}$")
# How long stop() waits after SIGKILL for the last process to go (a process in uninterruptible sleep).
_KILL_WAIT = 10.0
# The few host variables ch-run itself needs ($USER is checked before anything); none of them reaches the rank.
_CH_RUN_ENVIRONMENT = ("USER", "LOGNAME", "HOME", "PATH", "TMPDIR", "LANG")


def _image_marker(path: str) -> Dict[str, object]:
    try:
        with open(os.path.splitext(os.path.realpath(path))[0] + ".json", encoding="utf-8") as marker:
            said = json.load(marker)
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}


def host_gpu_env(vendor: Optional[str], indices: Optional[List[int]]) -> Dict[str, str]:
    """The *_VISIBLE_DEVICES restricting the rank to the allocation's GPUs: ch-run shares the host's /dev, so the
    lists name host indices (AMD: ROCR by host index, HIP then counts what ROCR left, from 0)."""
    if not vendor or vendor.lower() == "none" or indices is None:
        return {}
    host = sorted(set(indices))
    if vendor.upper() == "NVIDIA":
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(index) for index in host)}
    if not host:
        return {"ROCR_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1"}
    inside = ",".join(str(position) for position in range(len(host)))
    return {"ROCR_VISIBLE_DEVICES": ",".join(str(index) for index in host), "HIP_VISIBLE_DEVICES": inside}


def rank_environment(run, variables: Mapping[str, str], launch=None) -> Dict[str, str]:
    """Every variable the rank gets, as docker_run_args gives them: the tools' and the user's (secrets among them),
    the launcher's tunables the user did not set, then who and where the rank is and its GPUs, which nothing
    overrides."""
    tools, _ = run_tools(run)
    launch = launch or run_launcher_environment(run)
    extra = translate(split_options(run.additional_docker_run_options, "additional_docker_run_options"), run.environ)
    tool_environment = tools.environment() if tools else {}
    user_names = {str(name) for name in (run.docker_env_vars or {})} | set(tool_environment) | set(extra.env)
    topology = {
        "MASTER_ADDR": run.master_addr,
        "MASTER_PORT": str(run.master_port),
        "NNODES": str(run.nnodes),
        "NODE_RANK": str(run.rank),
    }
    if run.gpu_vendor:
        try:
            topology.update(host_gpu_env(run.gpu_vendor, card_gpu_indices(run, allocated_gpu_indices(run.environ))))
        except ValueError as err:
            raise ModelRunError(f"cannot give the container its GPUs: {err}") from None
    topology.update(launch.identity)
    environment = {name: value for name, value in launch.defaults.items() if name not in user_names}
    environment.update(extra.env)
    environment.update(variables)
    environment.update(tool_environment)
    environment.update(topology)
    return environment


def _binds(run, launch) -> Tuple[List[Tuple[str, str]], str]:
    """([(host path, container path)], working dir): the model dir first, then the context's mounts and those of
    the options, then the node dir with the launcher's and the tools' files."""
    tools, _ = run_tools(run)
    if tools and PYSPY_TOOL in tools.names:
        raise ModelRunError(
            f"tool {PYSPY_TOOL} mounts the node's py-spy into the image, which a read-only Charliecloud image cannot "
            "take: leave it out (the hang watchdog and `slurm-multi stacks` read the ranks with py-spy from the host "
            "under charliecloud) or use container_runtime=docker"
        )
    extra = translate(split_options(run.additional_docker_run_options, "additional_docker_run_options"), run.environ)
    workdir = RUN_DIRECTORY if tools else WORKSPACE
    binds = {workdir: os.path.realpath(run.model_dir)}
    # The card's data (`host:container[:ro]`): ch-run 0.31's binds are read-write, the data's files keep the host's
    # permissions.
    data = [tuple(reversed(mount.split(":")[:2])) for mount in run.data_mounts]
    for target, source in list((run.docker_mounts or {}).items()) + data + list(extra.binds.items()):
        binds.setdefault(os.path.normpath(str(target)), str(source))
    if tools and run.tools_file and os.path.isfile(run.tools_file):
        binds.setdefault(WORKSPACE + "/scripts/common", os.path.dirname(os.path.realpath(run.tools_file)))
    if tools or launch.workspace_files:
        binds.setdefault(LAUNCHER_FILES_DIR, run.node_dir)
    return [(source, target) for target, source in binds.items()], extra.workdir or workdir


def _check_destinations(image: str, binds: Sequence[Tuple[str, str]]) -> None:
    """Every bind's destination must exist in the image (ch-run 0.31 cannot make one in a read-only image): checked
    in a directory image's tree, or against the mount points a squashfs image's marker lists."""
    if os.path.isdir(image):
        missing = [target for _, target in binds if not os.path.isdir(os.path.join(image, target.lstrip("/")))]
    else:
        listed = _image_marker(image).get("mount_points")
        if not isinstance(listed, list):
            return  # a marker that lists none: ch-run's own refusal reaches the log
        missing = [target for _, target in binds if target not in listed]
    if missing:
        raise ModelRunError(
            f"image {image} has no {', '.join(missing)} to bind the run's dirs at (a Charliecloud image is read-only: "
            f"its mount points are made when it is built, {', '.join(MOUNT_POINTS)} and the context's docker_mounts "
            "targets): rebuild the image with this context, or mount at one of those paths"
        )


def ch_run_argv(run, env_file: Optional[str], launch=None) -> List[str]:
    """``ch-run`` with the host's environment emptied, the image's own (``/ch/environment``) and then the private
    ``env_file``, the binds, the working dir, and the model's command."""
    launch = launch or run_launcher_environment(run)
    binds, workdir = _binds(run, launch)
    argv = [shutil.which(CH_RUN) or CH_RUN, "--unset-env=*"]
    if not os.path.isdir(run.image) or os.path.isfile(os.path.join(run.image, "ch", "environment")):
        argv.append("--set-env")  # the image's ENV: a squashfs image always holds /ch/environment (the build's)
    # No `$` expansion: values (secrets among them) are taken literally.
    argv.append("--env-no-expand")
    if env_file:
        argv.append(f"--set-env={env_file}")
    for source, target in binds:
        argv.append(f"--bind={source}:{target}")
    argv += [f"--cd={workdir}", run.image, "--"]
    tools, _ = run_tools(run)
    image_name = run.provenance.get("docker_image") or run.image
    command = model_command(run.script, run.model_args, image_name)
    return argv + (tools.command(command, image_name) if tools else command)


def format_ch_run_env_file(environment: Mapping[str, str]) -> Dict[str, str]:
    """The variables as ch-run's file syntax keeps them literal: it strips one pair of single quotes around a value,
    so every value is given inside one pair."""
    return {name: f"'{value}'" for name, value in environment.items()}


class _ProcessWatch(RankWatch):
    def __init__(self, process: subprocess.Popen):
        self.process = process

    def ended(self) -> bool:
        return self.process.poll() is not None

    def sleep(self, seconds: float) -> None:
        sleep_until_exit(self.process, seconds)


class _ThreadDrain(LogDrain):
    def __init__(self, thread):
        self.thread = thread

    def drain(self, timeout: float) -> None:
        self.thread.join(timeout)


class CharliecloudRank(Rank):
    """The rank's ``ch-run`` and every process it started."""

    def __init__(self, run):
        self.run = run
        self.process = None  # type: Optional[subprocess.Popen]
        self._log = None
        self._env_file = contextlib.ExitStack()
        self._variable_names = []  # type: List[str]
        self._seen = {}  # type: Dict[int, Optional[int]]

    def image_identity(self) -> Optional[str]:
        return image_identity(self.run.image)

    def start(self, variables: Mapping[str, str], launch, log_path: str, secret_values: Sequence[str]) -> None:
        run = self.run
        environment = rank_environment(run, variables, launch)
        self._variable_names = sorted(environment)
        argv = ch_run_argv(run, "<env file>", launch)
        binds = [tuple(arg[len("--bind=") :].rsplit(":", 1)) for arg in argv if arg.startswith("--bind=")]
        _check_destinations(run.image, binds)
        try:
            env_file = self._env_file.enter_context(container_env_file(format_ch_run_env_file(environment)))
            argv[argv.index("--set-env=<env file>")] = f"--set-env={env_file}"
            # What the rank gets, secrets masked, heads run.log (docs/using.md, "The container's command").
            head = command_lines(argv, environment, secret_values)
            write_log_head(log_path, head)
            own = {name: os.environ[name] for name in _CH_RUN_ENVIRONMENT if name in os.environ}
            own.setdefault("USER", run.user)
            # Its own session, hence process group: stop() signals the whole rank, and a signal meant for this
            # module's group (a terminal's Ctrl-C) does not end the rank before its diagnostics.
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=own,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as err:
            self._env_file.close()
            raise ModelRunError(f"cannot start {CH_RUN} on {run.node}: {err} (is Charliecloud installed?)") from None
        self._log = copy_log_in_background(self.process.stdout, log_path, secret_values, head)
        process_tree.write_rank_pid_file(run.node_dir, self.process.pid, run.rank, run.container)

    def follow_log(self, log_path: str, secret_values: Sequence[str]) -> LogDrain:
        return _ThreadDrain(self._log)

    def watch(self) -> RankWatch:
        return _ProcessWatch(self.process)

    def state(self) -> Tuple[bool, Optional[int]]:
        code = self.process.poll()
        if code is None:
            return True, None
        return False, code if code >= 0 else 128 - code  # a signal's end as Docker reports it: 128 + N

    def _pids(self) -> List[int]:
        pids = process_tree.tree_pids(self.process.pid, self.process.pid)
        for pid in pids:
            # Remembered by start time: a child of the rank that left its group (setsid) is stopped with it even
            # once its parent is gone and it hangs off init, and a reused pid is never taken for it.
            self._seen.setdefault(pid, process_tree.start_time(pid))
        return pids

    def _left(self) -> List[int]:
        """The rank's processes still there: its tree now, and any seen before that runs on."""
        now = set(self._pids())
        return sorted(now | {pid for pid, started in self._seen.items() if process_tree.start_time(pid) == started})

    def stop(self, grace: float) -> None:
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self.process.poll()  # reap ch-run itself: a zombie counts as a process
            if not self._left():
                break
            time.sleep(0.1)
        deadline = time.monotonic() + _KILL_WAIT
        while time.monotonic() < deadline:
            self.process.poll()
            if not self._left():
                break
            self._signal_all(signal.SIGKILL)
            time.sleep(0.05)
        self.process.wait(_KILL_WAIT)

    def _signal_all(self, signum: int) -> None:
        left = self._left()  # before the signal: a parent's end orphans its children out of the tree
        with contextlib.suppress(OSError):
            os.killpg(self.process.pid, signum)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

    def snapshot(self, path: str, **options) -> str:
        return write_diagnostics(path, self.diagnostics(**options))

    def diagnostics(
        self,
        log_dirs: Sequence[str] = DEFAULT_LOG_DIRS,
        secret_values: Sequence[str] = (),
        tail_lines: int = DEFAULT_TAIL_LINES,
        reason: str = "",
        **_budget,
    ) -> str:
        """The host's view of the rank: its state, process tree, listening sockets, log files' and run.log's tails."""
        running, exit_code = self.state()
        pids = self._pids()
        table, _ = process_tree.listing(pids)
        sections = [
            (
                "state",
                f"Running: {running}\nExitCode: {exit_code}\nPid: {self.process.pid}\nImage: {self.run.image}\n"
                f"Environment variable names (values omitted): {' '.join(self._variable_names)}",
            ),
            ("process tree (from the host)", table),
            ("listening sockets (from the host)", "\n".join(process_tree.listening_sockets(pids)) or "(none)"),
        ]
        if running and pids:
            for log_dir in log_dirs:
                sections.append(
                    (
                        f"log files under {log_dir} (last {tail_lines} lines each)",
                        _log_tails(pids[0], log_dir, tail_lines),
                    )
                )
        run_log = os.path.join(self.run.node_dir, "run.log")
        sections.append((f"container log (last {tail_lines} lines)", _tail(run_log, tail_lines)))
        taken_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        header = [f"# slurm-multi diagnostics of rank {self.run.container} (charliecloud)", f"# taken at {taken_at}"]
        if reason:
            header.append(f"# reason: {reason}")
        body = [f"\n== {title} ==\n{text}" for title, text in sections]
        return mask_secrets("\n".join(header) + "\n" + "\n".join(body) + "\n", secret_values)

    def stacks(self, why: str, secret_values: Sequence[str], log_path: str) -> Dict[str, object]:
        return take_container_stacks(
            self.run.container,
            self.run.rank,
            self.run.node,
            why,
            secret_values=secret_values,
            log_path=log_path,
            processes=process_tree.listing(self._pids()),
        )

    def activity(self) -> Optional[Dict[int, object]]:
        if self.process is None:
            return {}
        found = {pid: process_activity(pid) for pid in self._pids()}
        return {pid: done for pid, done in found.items() if done is not None}

    def remove(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop(0)
        self._env_file.close()
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.run.node_dir, process_tree.RANK_PID_FILE))


def _tail(path: str, lines: int) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - 256 * 1024))
            return "\n".join(log.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError as err:
        return f"unreadable: {err}"


def _log_tails(pid: int, log_dir: str, lines: int) -> str:
    """The ``*.log`` files under ``log_dir`` as the rank sees it (its root, /proc/<pid>/root), 20 at most."""
    root = f"/proc/{pid}/root"
    where = os.path.join(root, log_dir.lstrip("/"))
    found = []
    for directory, _, names in os.walk(where):
        if directory[len(where) :].count(os.sep) >= 3:
            continue
        found += [os.path.join(directory, name) for name in sorted(names) if name.endswith(".log")]
    parts = [f"==> {path[len(root) :]} <==\n{_tail(path, lines)}" for path in found[:20]]
    return "\n".join(parts) or "(none)"


class CharliecloudRuntime(ContainerRuntime):
    """Charliecloud: no daemon, the ranks the user's own processes."""

    name = "charliecloud"
    image_holder = (
        "storage as a committed Charliecloud image (a <digest>.sqfs with its marker, or an unpacked <digest> dir)"
    )
    errors = ()
    # Docker's daemon, its disk and its stale GPU containers: no daemon here (its own disk is the unpack dir's).
    replaces_checks = ("docker", "disk", "stale_gpu_containers")

    def rank(self, run) -> Rank:
        return CharliecloudRank(run)

    def node_checks(self, node: str, settings, builds: bool):
        # `image_access`: whether this node runs the shared squashfs in place or unpacks it.
        problems, notes, access = charliecloud_checks(node, settings, builds=builds)
        return problems, notes, {"image_access": access}

    def builder(self, params, cards, zoo_root: str):
        return charliecloud_builder(params, cards, zoo_root)

    def plan(self, run, env_file: Optional[str]) -> List[str]:
        return ch_run_argv(run, env_file or "<env file>")
