"""The seam between the stages and the container runtime (docs/runtimes.md): the few verbs the run stage needs, and the
build's and preflight's, one implementation per runtime in module_utils/runtimes/. No stage names a runtime: its
module picks one by the job's ``container_runtime`` (runtimes.by_name) and asks it."""

from __future__ import annotations

import os
import select
import subprocess
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Type


def sleep_until_exit(process: subprocess.Popen, seconds: float) -> None:
    """Sleep ``seconds`` or until ``process`` ends (its pidfd wakes at the exit): every node's task ends as its rank
    does, not a poll later, and the job waits for the last node."""
    try:
        pidfd = os.pidfd_open(process.pid)  # not reaped yet (only poll() reaps it): a zombie's pidfd is ready at once
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3)
        time.sleep(seconds)
        return
    try:
        select.select([pidfd], [], [], seconds)
    finally:
        os.close(pidfd)


class LogDrain:
    """The rank's output on its way into the node's run.log, secrets masked (module_utils/run/container_log.py)."""

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the rest of the output to reach the file."""
        raise NotImplementedError


class RankWatch:
    """A wait on the rank's end that wakes at once when it ends (no polling of the runtime while the model runs)."""

    def ended(self) -> bool:
        """Whether the rank's container has ended."""
        raise NotImplementedError

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when the rank ends meanwhile."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the watch holds (a waiting child process)."""


class Rank:
    """One node's rank of one job under one runtime: what the run stage does to its container."""

    def image_identity(self) -> Optional[str]:
        """The identity (``sha256:<hex>``) of the image this node would run; None when the node does not hold it."""
        raise NotImplementedError

    def clear_leftover(self) -> None:
        """Remove what an earlier attempt of this job and rank left on the node (a container of the same name)."""

    def start(self, variables: Mapping[str, str], launch, log_path: str, secret_values: Sequence[str]) -> None:
        """Start the rank detached: ``variables`` (the user's environment and secrets) reach it privately, never by
        argv; ``launch`` is the launcher's environment (model_run_spec.run_launcher_environment)."""
        raise NotImplementedError

    def follow_log(self, log_path: str, secret_values: Sequence[str]) -> LogDrain:
        """The rank's output following into ``log_path`` with ``secret_values`` masked."""
        raise NotImplementedError

    def watch(self) -> RankWatch:
        """A watch on the rank's end."""
        raise NotImplementedError

    def state(self) -> Tuple[bool, Optional[int]]:
        """(running, exit code or None)."""
        raise NotImplementedError

    def stop(self, grace: float) -> None:
        """Stop the rank: SIGTERM, and SIGKILL after ``grace`` seconds; nothing of it left running."""
        raise NotImplementedError

    def snapshot(self, path: str, **options) -> str:
        """Write the diagnostics snapshot (module_utils/run/diagnostics.py's options) into ``path``; OSError only."""
        raise NotImplementedError

    def stacks(self, why: str, secret_values: Sequence[str], log_path: str) -> Dict[str, object]:
        """Every process's Python stacks as stacks.json holds them (module_utils/run/hang/stacks.py)."""
        raise NotImplementedError

    def activity(self) -> Optional[Dict[int, object]]:
        """Each process's hang-watch `Activity` by host pid; None: the watchdog reads the container by its name."""
        return None

    def remove(self) -> None:
        """Remove what the rank leaves on the node once its diagnostics are taken."""


class ImageBuilder:
    """How a runtime that builds its own images builds each of the job's on rank 0 (library/build_images.py)."""

    def ensure(self, plan, force_rebuild: bool, check_mode: bool):
        """Reuse or build ``plan``'s image (an image.build.ImageBuildPlan): its image.build.BuildOutcome."""
        raise NotImplementedError

    def manifest_fields(self, outcome) -> Dict[str, object]:
        """What this runtime adds to (or changes in) the outcome's build_manifest.json entry."""
        return {}


class ContainerRuntime:
    """A container runtime as the stages see it."""

    name = ""
    # Where a node holds the images it runs, as an error names it ("node1's docker daemon").
    image_holder = ""
    # The exceptions its verbs raise for an infrastructure failure (the task fails, the other ranks are told).
    errors: Tuple[Type[BaseException], ...] = ()
    # The node preflight's Docker checks (module_utils/node/preflight.py's CHECKS) that mean nothing under this
    # runtime: they do not run, and its `node_checks` take the place of `docker` and `disk`.
    replaces_checks: Tuple[str, ...] = ()

    def rank(self, run) -> Rank:
        """The rank ``run`` (a model_run_spec.ModelRun) describes, under this runtime."""
        raise NotImplementedError

    def plan(self, run, env_file: Optional[str]) -> List[str]:
        """The argv that would start the rank (check mode), ``env_file`` standing for the private environment file."""
        raise NotImplementedError

    def announced_identity(self, run) -> Optional[str]:
        """The identity this node announces at the barrier (``sha256:<hex>``); None: it does not hold the image."""
        return self.rank(run).image_identity()

    def image_to_run(self, reference: str, image_id: Optional[str]) -> str:
        """What the rank runs, of the image's ``reference`` and the ``image_id`` the build stage checked on every node
        (either may be empty)."""
        return reference

    def node_checks(
        self, node: str, settings: Mapping[str, object], builds: bool
    ) -> Tuple[List[dict], List[str], Dict[str, object]]:
        """(problems, notes, fields) of this runtime on ``node``, in place of the Docker checks it replaces:
        ``settings`` are the node_preflight module's, ``builds`` that this node builds the image (rank 0); each
        problem is ``{"check", "problem", "fix"}``; ``fields`` join the node's preflight result."""
        return [], [], {}

    def builder(self, params: Mapping[str, object], cards: Sequence[dict], zoo_root: str) -> Optional[ImageBuilder]:
        """This runtime's own builder for the build module's ``params`` and the selected ``cards`` (refusing with a
        UserError what it cannot build), or None: Docker's build (module_utils/image/build.py) makes the image."""
        return None
