"""A rank under Docker: ``docker run -d --init`` waited on by ``docker wait``, followed by ``docker logs -f``, stopped
through the daemon's API; thin over docker_api, docker_cli and the run stage's Docker-reading parts."""

from __future__ import annotations

import contextlib
import subprocess
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import docker_api
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import (
    DockerError,
    docker_argv,
    image_id,
    run_docker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import container_env_file
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.stale_containers import remove_container
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_command import command_lines
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_log import LogFollower, write_log_head
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_runtime import (
    ContainerRuntime,
    LogDrain,
    Rank,
    RankWatch,
    sleep_until_exit,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.diagnostics import write_container_diagnostics
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.stacks import take_container_stacks
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import docker_run_args


def container_state(name: str) -> Tuple[bool, Optional[int]]:
    """(running, exit code) of a container, through the API where it answers."""
    state = docker_api.container_state(name)
    if state is not None and isinstance(state.get("ExitCode"), int):
        return state.get("Running") is True, state["ExitCode"]
    completed = run_docker(
        ["inspect", "--type", "container", "--format", "{{.State.Running}} {{.State.ExitCode}}", name], timeout=30
    )
    running, _, exit_code = completed.stdout.strip().partition(" ")
    return running == "true", int(exit_code) if exit_code.lstrip("-").isdigit() else None


def stop_container(name: str, grace: float) -> None:
    """``docker stop`` through the API: SLURM's SIGTERM, which reaches every process of the step, would kill a
    `docker stop` child midway (a time limit, a scancel) and leave the container running."""
    if docker_api.stop_container(name, int(grace)) is None:
        run_docker(["stop", "-t", str(int(grace)), name], timeout=grace + 30)


def _start_waiter(name: str) -> subprocess.Popen:
    # `docker wait` blocks in the daemon until the container ends: no polling of docker while the model runs.
    return subprocess.Popen(
        docker_argv(["wait", name]), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


class _DockerWatch(RankWatch):
    def __init__(self, container: str):
        self.container = container
        self.waiter = _start_waiter(container)

    def ended(self) -> bool:
        if self.waiter.poll() is None:
            return False
        running, _ = container_state(self.container)
        if not running:
            return True
        # The waiter died while the container runs on (a signal meant for us, a daemon hiccup): rewatch.
        self.waiter = _start_waiter(self.container)
        return False

    def sleep(self, seconds: float) -> None:
        sleep_until_exit(self.waiter, seconds)

    def close(self) -> None:
        if self.waiter.poll() is None:
            self.waiter.kill()
        self.waiter.wait()


class _LogDrain(LogDrain):
    def __init__(self, follower: LogFollower):
        self.follower = follower

    def drain(self, timeout: float) -> None:
        self.follower.drain(timeout)


class DockerRank(Rank):
    """The rank's container ``slurm-multi-<job>-r<rank>`` on this node's daemon."""

    def __init__(self, run):
        self.run = run
        self.container = run.container
        self.log_head = []  # type: List[str]

    def image_identity(self) -> Optional[str]:
        return image_id(self.run.image)

    def clear_leftover(self) -> None:
        remove_container(self.container)

    def start(self, variables: Mapping[str, str], launch, log_path: str, secret_values: Sequence[str]) -> None:
        # The env file lives only while `docker run` reads it.
        env_file_block = container_env_file(variables) if variables else None
        with env_file_block or contextlib.nullcontext() as env_file:
            args = docker_run_args(self.run, env_file, launch)
            # What the container gets, secrets masked, heads run.log (docs/using.md, "The container's command").
            self.log_head = command_lines(docker_argv(args), variables, secret_values)
            write_log_head(log_path, self.log_head)
            run_docker(args, timeout=120)

    def follow_log(self, log_path: str, secret_values: Sequence[str]) -> LogDrain:
        return _LogDrain(LogFollower(self.container, log_path, secret_values, self.log_head).start())

    def watch(self) -> RankWatch:
        return _DockerWatch(self.container)

    def state(self) -> Tuple[bool, Optional[int]]:
        return container_state(self.container)

    def stop(self, grace: float) -> None:
        stop_container(self.container, grace)

    def snapshot(self, path: str, **options) -> str:
        return write_container_diagnostics(path, self.container, **options)

    def stacks(self, why: str, secret_values: Sequence[str], log_path: str) -> Dict[str, object]:
        return take_container_stacks(
            self.container, self.run.rank, self.run.node, why, secret_values=secret_values, log_path=log_path
        )

    def remove(self) -> None:
        remove_container(self.container)


class DockerRuntime(ContainerRuntime):
    """Docker: a daemon on every node, the containers its own."""

    name = "docker"
    image_holder = "docker daemon"
    errors = (DockerError,)

    def rank(self, run) -> Rank:
        return DockerRank(run)

    def plan(self, run, env_file: Optional[str]) -> List[str]:
        return docker_argv(docker_run_args(run, env_file))

    def image_to_run(self, reference: str, image_id: Optional[str]) -> str:
        # The ID the barrier checked on every node, never the tag (another job on the node can move a tag meanwhile).
        return image_id or reference

    def announced_identity(self, run) -> Optional[str]:
        # The role gives Docker's image by the very ID the barrier compares (never a tag another job could move).
        return run.image
