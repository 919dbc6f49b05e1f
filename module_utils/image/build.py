"""Building a model card's images with `docker build` on this node, or reusing the ones already built.

`plan_image_builds` makes one plan per (card, Dockerfile) and fails before anything is built; `ensure_image`
resolves its base images (no `--pull`: labs build offline), which completes the fingerprint, and reuses an image
labelled with it, or builds it. Secrets come only as BuildKit secret mounts (build_secrets.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import time
from collections import namedtuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import (
    DockerError,
    image_inspect,
    run_docker,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import new_manifest
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_secrets import (
    BuildSecretError,
    build_secret_files,
    build_secrets_for,
    check_build_args,
    dockerfile_mounts,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.dockerfile_bases import (
    DockerfileBaseError,
    base_docker,
    dockerfile_base_images,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.dockerfile_selection import (
    build_args_from_context,
    build_context_dir,
    read_dockerfile_context,
    select_dockerfiles,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    FINGERPRINT_LABEL,
    build_fingerprint,
    digest_reference,
    dockerfile_stem,
    local_image_name,
    registry_image_name,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry import pushed_digest
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry_credentials import logged_in
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import SecretMasker, mask_secrets
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

LOG_TAIL_LINES = 30
# A build step printing without newlines must not make one line take all the memory: longer lines are cut.
_MAX_LOG_LINE = 1 << 20

# The keys in which a previous manifest's entry for a reused image must equal the new one to be kept as it is.
_SAME_IMAGE_KEYS = ("image_id", "build_fingerprint", "registry_image", "registry_image_by_digest")
# What the docker CLI 23+ says when BuildKit is asked for but its buildx component is missing.
_NO_BUILDX = "buildx component is missing"

ImageBuildPlan = namedtuple(
    "ImageBuildPlan",
    "model image_name dockerfile context_dir build_args build_secrets buildkit fingerprint log_file base_docker "
    "gpu_vendor base_references base_images",
)
ImageBuildPlan.__doc__ = """One image to have: a model card built from one Dockerfile.

`build_secrets`: {id: value} of the `MAD_SECRETS_*` secrets the Dockerfile mounts. `base_references`: the images
its FROM lines name. `base_images` ({reference: image ID}) and `fingerprint` are None until `resolve_base_images`."""

BuildOutcome = namedtuple("BuildOutcome", "plan action image_id build_duration reason")
BuildOutcome.__doc__ = """What `ensure_image` did: action is "built", "reused" or "would_build" (check mode)."""


class ImageBuildError(UserError):
    """A build, inspect or push that failed, with what the user needs to fix it."""


def build_log_name(model_name: str, dockerfile) -> str:
    """MAD's build log file name: `<model>_<dockerfile stem>.build.live.log` (`/` in names becomes `_`)."""
    return f"{model_name}_{dockerfile_stem(dockerfile)}.build.live.log".replace("/", "_")


def plan_image_builds(zoo_root, cards: list, run_context: dict, log_dir, secrets_file=None) -> list:
    """One `ImageBuildPlan` per (selected card, fitting Dockerfile), in order; refuses a bad plan before any build."""
    build_args = build_args_from_context(run_context)
    plans, owners = [], {}
    try:
        check_build_args(build_args)
        for card in cards:
            context_dir = build_context_dir(zoo_root, card)
            for dockerfile in select_dockerfiles(zoo_root, card, run_context):
                image_name = local_image_name(card["name"], dockerfile)
                if image_name in owners:
                    raise ImageBuildError(
                        f"models {owners[image_name]!r} and {card['name']!r} would both build image {image_name}; "
                        "rename one of them"
                    )
                owners[image_name] = card["name"]
                gpu_vendor = read_dockerfile_context(dockerfile).get("gpu_vendor") or run_context.get("gpu_vendor", "")
                plan = image_build_plan(
                    card, image_name, dockerfile, context_dir, build_args, log_dir, secrets_file, gpu_vendor
                )
                plans.append(plan if plan.base_references else with_base_images(plan, {}))
    except (BuildSecretError, DockerfileBaseError) as error:
        raise ImageBuildError(str(error)) from None
    return plans


def image_build_plan(
    card: dict, image_name: str, dockerfile, context_dir, build_args: dict, log_dir, secrets_file=None, gpu_vendor=""
) -> ImageBuildPlan:
    """The plan to build `image_name` for `card` from `dockerfile`, its base images not resolved yet."""
    mounts = dockerfile_mounts(dockerfile)
    bases = dockerfile_base_images(dockerfile, build_args)
    return ImageBuildPlan(
        model=card,
        image_name=image_name,
        dockerfile=dockerfile,
        context_dir=context_dir,
        build_args=build_args,
        build_secrets=build_secrets_for(dockerfile, mounts, secrets_file),
        buildkit=bool(mounts),
        fingerprint=None,
        log_file=os.path.join(os.path.abspath(str(log_dir)), build_log_name(card["name"], dockerfile)),
        base_docker=base_docker(bases, build_args),
        gpu_vendor=gpu_vendor,
        base_references=tuple(bases.references),
        base_images=None,
    )


def with_base_images(plan: ImageBuildPlan, base_images: dict) -> ImageBuildPlan:
    """`plan` with its base images' IDs ({reference: image ID}) and the fingerprint they complete."""
    base_images = {reference: base_images[reference] for reference in plan.base_references}
    fingerprint = build_fingerprint(plan.dockerfile, plan.build_args, plan.context_dir, base_images)
    return plan._replace(base_images=base_images, fingerprint=fingerprint)


def base_image_ids(references, env=None) -> dict:
    """{reference: the image ID this node's daemon resolves it to, or None when it has no such image}."""
    ids = {}
    for reference in references:
        found = inspect_image(reference, env)
        ids[reference] = found[0] if found else None
    return ids


def pull_base_image(plan: ImageBuildPlan, reference: str, env=None) -> None:
    """`docker pull` a base image the daemon lacks, its output in the plan's build log (which the build appends to)."""
    header = f"base image {reference} is not on this node's daemon: docker pull {reference}"
    returncode, _ = _run_into_log(["docker", "pull", reference], plan.log_file, header, env)
    if returncode != 0:
        raise ImageBuildError(
            f"{plan.dockerfile} builds on {reference}, which this node's daemon does not have, and `docker pull "
            f"{reference}` failed (exit {returncode}): build or load it on this node (or log in to its registry). "
            f"Last lines of {plan.log_file}:\n{build_log_tail(plan.log_file)}"
        )


def resolve_base_images(plan: ImageBuildPlan, env=None, pull: bool = True):
    """(`plan` with its base images resolved, the references the daemon lacked); a missing base is pulled first,
    or, without `pull` (check mode), the plan is None."""
    if plan.base_images is not None:
        return plan, []
    ids = base_image_ids(plan.base_references, env)
    missing = [reference for reference, found in ids.items() if found is None]
    if missing and not pull:
        return None, missing
    for reference in missing:
        pull_base_image(plan, reference, env)
    if missing:
        ids = base_image_ids(plan.base_references, env)
        still = [reference for reference, found in ids.items() if found is None]
        if still:
            raise ImageBuildError(f"{still[0]} is still not on this node's daemon after `docker pull` reported success")
    return with_base_images(plan, ids), missing


def docker_build_argv(plan: ImageBuildPlan, no_cache: bool = False, secret_files=None, docker_cli="docker") -> list:
    """The `docker build` argv for a plan; `secret_files` ({id: path}) gives each `--secret` its source, without it
    the command only names the ids (as the manifest records it)."""
    argv = [docker_cli, "build", "--network=host", "-t", plan.image_name, "-f", plan.dockerfile]
    argv += ["--label", f"{FINGERPRINT_LABEL}={plan.fingerprint}"]
    if plan.buildkit:
        argv.append("--progress=plain")  # the steps' output in the log, as the classic builder writes it
    if no_cache:
        argv.append("--no-cache")
    for name in sorted(plan.build_args):
        argv += ["--build-arg", f"{name}={plan.build_args[name]}"]
    for secret_id in sorted(plan.build_secrets):
        source = f",src={secret_files[secret_id]}" if secret_files else ""
        argv += ["--secret", f"id={secret_id}{source}"]
    argv.append(plan.context_dir)
    return argv


def build_command(plan: ImageBuildPlan, argv: list) -> str:
    """`argv` as a shell command line, with the `DOCKER_BUILDKIT=1` a BuildKit build runs with."""
    return ("DOCKER_BUILDKIT=1 " if plan.buildkit else "") + shlex.join(argv)


def _daemon_host(env):
    """The daemon an `env` for the docker CLI selects (None: the CLI's own default)."""
    return None if env is None else env.get("DOCKER_HOST")


def inspect_image(image: str, env=None):
    """(image ID, labels) of a local image, or None when the daemon has no such image."""
    try:
        inspected = image_inspect(image, host=_daemon_host(env))
    except DockerError as error:
        raise ImageBuildError(str(error)) from None
    if inspected is None:
        return None
    return inspected.get("Id"), dict((inspected.get("Config") or {}).get("Labels") or {})


def _run_into_log(argv: list, log_file: str, header: str, env, append: bool = True, secret_values=()) -> tuple:
    """Run a long docker command (pull, build, push: no timeout) with `header` and its output written to the build
    log, secrets masked in every line as it is written; (its exit code, where its output starts in the log)."""
    masker = SecretMasker(secret_values)
    with open_build_log(log_file, append=append) as log:
        log.write(f"# {header}\n".encode())
        log.flush()
        output_start = log.tell()
        try:
            process = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        except FileNotFoundError:
            raise ImageBuildError("the docker CLI is not on PATH on this node") from None
        with process.stdout:
            for chunk in iter(lambda: process.stdout.readline(_MAX_LOG_LINE), b""):
                log.write(masker.feed(chunk))
                log.flush()
        log.write(masker.flush())
        return process.wait(), output_start


def open_build_log(path: str, append: bool = False):
    """The build log, for writing in binary: readable by its owner and its dir's group only, whatever the umask,
    since a build step may print what it should not."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o640)
    try:
        os.fchmod(fd, 0o640)
        with contextlib.suppress(OSError):  # a user outside that group keeps the log to themselves
            os.fchown(fd, -1, os.stat(os.path.dirname(path)).st_gid)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab" if append else "wb")


def build_log_tail(path: str) -> str:
    """The last LOG_TAIL_LINES lines of a build log, for an error that names the log."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-LOG_TAIL_LINES:])
    except OSError:
        return ""


def run_docker_build(
    plan: ImageBuildPlan, env=None, no_cache: bool = False, buildkit_cli: str = "docker", append_log: bool = False
) -> float:
    """Run `docker build` for a plan into its log (`append_log`: after the base's pull); the duration."""
    build_env = dict(os.environ if env is None else env)
    docker_cli = "docker"
    if plan.buildkit:
        build_env["DOCKER_BUILDKIT"] = "1"
        docker_cli = buildkit_cli or "docker"
    started = time.monotonic()
    secret_values = list(plan.build_secrets.values())
    with build_secret_files(plan.build_secrets) as secret_files:
        argv = docker_build_argv(plan, no_cache, secret_files, docker_cli)
        header = f"model {plan.model['name']}: {build_command(plan, argv)}"
        returncode, _ = _run_into_log(argv, plan.log_file, header, build_env, append_log, secret_values)
    duration = time.monotonic() - started
    if returncode != 0:
        tail = mask_secrets(build_log_tail(plan.log_file), secret_values)
        hint = ""
        if _NO_BUILDX in tail:
            hint = (
                f"\n{plan.dockerfile} uses RUN --mount, which needs BuildKit, and the docker CLI {docker_cli!r} "
                "has no BuildKit: install its buildx component (docker-buildx-plugin) on this node, or set "
                "buildkit_docker_cli to a docker CLI that has BuildKit (Docker 20.10's has it built in)"
            )
        raise ImageBuildError(
            f"docker build of {plan.image_name} from {plan.dockerfile} failed (exit {returncode}); "
            f"full log: {plan.log_file}; last lines:\n{tail}{hint}"
        )
    return duration


def reuse_reason(plan: ImageBuildPlan, existing) -> tuple:
    """(reusable, reason): whether an existing image (`inspect_image` result or None) fits the plan, and why."""
    if existing is None:
        return False, f"no image {plan.image_name} on this node"
    found = existing[1].get(FINGERPRINT_LABEL)
    if found != plan.fingerprint:
        bases = ", ".join(f"{reference} = {image_id}" for reference, image_id in sorted(plan.base_images.items()))
        over = f"; its base images now: {bases}" if bases else ""
        return False, f"image {plan.image_name} was built from other inputs (fingerprint {found or 'none'}){over}"
    return True, f"image {plan.image_name} has the same build fingerprint"


def _check_bases_held(plan: ImageBuildPlan, env) -> None:
    """Refuse a build during which a base image changed on the daemon: its label would name the wrong base."""
    now = base_image_ids(plan.base_references, env)
    for reference, image_id in sorted(plan.base_images.items()):
        if now.get(reference) != image_id:
            raise ImageBuildError(
                f"the base image {reference} changed on this node's daemon while {plan.image_name} was built "
                f"({image_id} before, {now.get(reference) or 'none'} after): run the job again"
            )


def ensure_image(
    plan: ImageBuildPlan, env=None, force_rebuild: bool = False, check_mode: bool = False, buildkit_cli: str = "docker"
):
    """Reuse the plan's image when its fingerprint label matches, else build it (not in check mode); the outcome's
    plan has its base images resolved. `env` is the docker CLI's environment (None: this process's)."""
    resolved, pulled = resolve_base_images(plan, env, pull=not check_mode)
    if resolved is None:
        reason = f"base image {pulled[0]} is not on this node's daemon: the build would pull it"
        return BuildOutcome(plan, "would_build", None, 0.0, reason)
    plan = resolved
    existing = inspect_image(plan.image_name, env)
    reusable, reason = reuse_reason(plan, existing)
    if reusable and not force_rebuild:
        return BuildOutcome(plan, "reused", existing[0], 0.0, reason)
    if force_rebuild:
        reason = "force_rebuild is set"
    if check_mode:
        return BuildOutcome(plan, "would_build", None, 0.0, reason)
    duration = run_docker_build(plan, env, no_cache=force_rebuild, buildkit_cli=buildkit_cli, append_log=bool(pulled))
    _check_bases_held(plan, env)
    built = inspect_image(plan.image_name, env)
    if built is None:
        raise ImageBuildError(f"docker build reported success but image {plan.image_name} is missing")
    return BuildOutcome(plan, "built", built[0], duration, reason)


def push_image(local_image: str, remote_image: str, log_file: str, env=None) -> str:
    """Tag `local_image` as `remote_image`, push it (output appended to `log_file`, logged in by `env`'s
    DOCKER_CONFIG) and return it by the digest this push reported (`<repository>@sha256:...`)."""
    try:
        run_docker(["tag", local_image, remote_image], host=_daemon_host(env))
    except DockerError as error:
        raise ImageBuildError(str(error)) from None
    argv = ["docker", "push", remote_image]
    returncode, push_started = _run_into_log(argv, log_file, f"docker push {remote_image}", env)
    if returncode != 0:
        raise ImageBuildError(
            f"docker push {remote_image} failed (exit {returncode}); if the registry needs a login, give its "
            f"credentials (credentials_file, `--credentials credential.json`). Last lines of {log_file}:\n"
            f"{build_log_tail(log_file)}"
        )
    with open(log_file, encoding="utf-8", errors="replace") as log:
        log.seek(push_started)
        digest = pushed_digest(log.read())
    if digest is None:
        raise ImageBuildError(
            f"docker push {remote_image} reported no digest, so workers could not pull exactly "
            f"this image; see {log_file}"
        )
    return digest_reference(remote_image, digest)


def push_images(outcomes: list, registry: str, credentials_file=None, on_secret=None) -> tuple:
    """Push every outcome's image to `registry`, logged in with `credentials_file` when given (`on_secret` gets the
    password first); ({local name: tag pushed}, {local name: reference by digest})."""
    tags, by_digest = {}, {}
    with logged_in(credentials_file, registry, on_secret=on_secret) as login_env:
        env = dict(os.environ, **login_env) if login_env else None
        for outcome in outcomes:
            name = outcome.plan.image_name
            tags[name] = registry_image_name(registry, name)
            by_digest[name] = push_image(name, tags[name], outcome.plan.log_file, env=env)
    return tags, by_digest


def git_commit(path: str) -> str:
    """The commit the git checkout holding ``path`` (the model zoo) is at, or "" outside one (or without git)."""
    try:
        completed = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    commit = completed.stdout.strip()
    return commit if completed.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", commit) else ""


def manifest_image_entry(
    outcome: BuildOutcome, registry=None, registry_image=None, registry_image_by_digest=None
) -> dict:
    """The outcome as a `built_images` entry of build_manifest.json (MAD's keys, then ours)."""
    plan = outcome.plan
    entry = {
        "model": plan.model["name"],
        "docker_image": plan.image_name,
        "dockerfile": plan.dockerfile,
        "base_docker": plan.base_docker,
        # madengine's: the first digest `docker manifest inspect <base_docker>` prints, for a one-platform image
        # its config digest, which is its image ID. Here the ID the build used, as this node's daemon resolved it.
        "docker_sha": (plan.base_images or {}).get(plan.base_docker, ""),
        "build_duration": round(outcome.build_duration, 3),
        "build_command": build_command(plan, docker_build_argv(plan)),
        "log_file": plan.log_file if outcome.action == "built" or os.path.exists(plan.log_file) else "",
        "gpu_vendor": plan.gpu_vendor,
        "image_id": outcome.image_id,
        "build_fingerprint": plan.fingerprint,
        # Every image the FROM lines name, with the ID the fingerprint counts (a multi-stage build has several).
        "base_images": dict(plan.base_images or {}),
        "git_commit": git_commit(plan.context_dir),
    }
    if registry:
        entry["registry"] = registry
        entry["registry_image"] = registry_image
        entry["registry_image_by_digest"] = registry_image_by_digest
    return entry


def record_builds(
    outcomes: list,
    run_context: dict,
    deployment_config=None,
    previous_manifest=None,
    registry=None,
    registry_images=None,
    registry_images_by_digest=None,
) -> dict:
    """The build manifest for `outcomes`; `registry_images(_by_digest)`: {local image name: reference pushed}. A
    reused image keeps its previous entry when it names the same image (an unchanged run rewrites nothing)."""
    previous_images = (previous_manifest or {}).get("built_images") or {}
    registry_images = registry_images or {}
    registry_images_by_digest = registry_images_by_digest or {}
    images, models = {}, {}
    for outcome in outcomes:
        name = outcome.plan.image_name
        entry = manifest_image_entry(outcome, registry, registry_images.get(name), registry_images_by_digest.get(name))
        earlier = previous_images.get(name)
        same = isinstance(earlier, dict) and all(earlier.get(key) == entry.get(key) for key in _SAME_IMAGE_KEYS)
        images[name] = earlier if outcome.action == "reused" and same else entry
        models[name] = outcome.plan.model
    return new_manifest(images, models, run_context, deployment_config)
