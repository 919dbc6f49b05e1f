"""Building a model's image with ch-image on rank 0, unprivileged, into one squashfs in the shared image cache.

MAD's Dockerfiles build as they are (`ARG BASE_DOCKER` before `FROM $BASE_DOCKER`, build args from the context, RUN).
Each base the FROM lines name comes from `charliecloud_bases` ({reference: a root filesystem tar or directory},
`ch-image import`, for air-gapped sites) or else from its registry (`ch-image pull`). A base is imported into
ch-image's node-local storage under its own reference once and kept there while it stays the same, so a rebuild
over an unchanged base starts at the model's own instructions.

The build fingerprint is Docker's (module_utils/image/names.py) over the bases' identities (a tar's or directory's
path, size and times; a registry base's reference) and the run's mount points: an entry of the cache whose marker has
it is reused with no build; a changed or moved base changes it, and the image is rebuilt.

Secrets: a Dockerfile's `RUN --mount=type=secret,id=MAD_SECRETS_X` reads /run/secrets/MAD_SECRETS_X as under
BuildKit. ch-image 0.31 has no secret mounts: the flag is taken out of a private copy of the Dockerfile and a private
0700 dir of 0600 files is bound at /run/secrets for the build's RUN steps (`ch-image build -b`), so the values are
read during the build and never written into the tree (a bind's files are not the image's), the build args, ch-image's
metadata or the log (masked there)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import tempfile
import time
from typing import Any, Dict, Mapping, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import (
    BuildOutcome,
    ImageBuildPlan,
    build_log_tail,
    open_build_log,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_secrets import (
    build_secret_files,
    dockerfile_mounts,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CacheDirectory,
    cache_operation,
    user_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import build_fingerprint
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import mask_secrets, node_local_tmp_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.commands import (
    CharliecloudError,
    ch_environment,
    ch_image_argv,
    find_command,
    run_logged,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.charliecloud.image import (
    prepare_tree,
    publish_tree,
    reusable_entry,
)

DEFAULT_STORAGE_DIR = "/var/tmp/slurm-multi-%u/ch-image"
SECRETS_TARGET = "/run/secrets"
# What the fingerprint counts besides the Dockerfile, its args, context and bases: this runtime and its mount points.
_RUNTIME_KEY = "runtime:charliecloud"
_BASES_RECORD_DIR = "bases"
_SECRET_MOUNT_FLAG = re.compile(r"\s--mount=(\S+)")


class CharliecloudBuild:
    """How this node builds: ch-image's storage (node-local), the site's or user's bases, the cache, mount points."""

    def __init__(self, cache: CacheDirectory, storage_dir: str = DEFAULT_STORAGE_DIR, bases=None, mount_points=()):
        self.cache = cache
        # Ours: ch-image's own storage (which holds nothing else) and the records of the bases imported into it.
        self.storage_dir = os.path.abspath(os.path.expanduser(user_cache_dir(storage_dir or DEFAULT_STORAGE_DIR)))
        self.ch_storage = os.path.join(self.storage_dir, "ch")
        self.bases = {str(name): str(path) for name, path in (bases or {}).items()}
        self.mount_points = tuple(sorted({str(point) for point in mount_points}))

    @property
    def env(self) -> Dict[str, str]:
        env = ch_environment(self.ch_storage)
        if find_command("git", env):
            # ch-image's build cache (a git repository in its storage): a rebuild checks out only what changed over
            # the base instead of copying its whole tree. Its commits need an identity; a new local user has none.
            env["CH_IMAGE_CACHE"] = "enabled"
            for role in ("AUTHOR", "COMMITTER"):
                env[f"GIT_{role}_NAME"], env[f"GIT_{role}_EMAIL"] = "slurm-multi", "slurm-multi@localhost"
        return env


# --- bases ---------------------------------------------------------------------------------------------------------


def _tree_digest(path: str) -> str:
    """A digest of a directory's entries' names, kinds, sizes and modification times (not their bytes)."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(dirs + files):
            full = os.path.join(root, name)
            try:
                status = os.lstat(full)
            except FileNotFoundError:
                continue
            relative = os.path.relpath(full, path)
            digest.update(f"{relative}\0{status.st_mode}\0{status.st_size}\0{status.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def base_identity(reference: str, bases: Mapping[str, str]) -> str:
    """What a base is, for the fingerprint: a named tar by its real path, size and mtime, a named directory by its path
    and its entries' sizes and times, a registry base by its reference. A named source that is missing is refused."""
    source = bases.get(reference)
    if source is None:
        return f"registry:{reference}"
    path = os.path.realpath(os.path.expanduser(source))
    try:
        status = os.stat(path)
    except OSError as err:
        raise CharliecloudError(
            f"charliecloud_bases names {source} for the base {reference}, and it cannot be read ({err.strerror}): "
            f"fix the path in charliecloud_bases (a root filesystem tar or directory) or remove {reference} from it "
            "to pull it from its registry"
        ) from None
    if os.path.isdir(path):
        return f"dir:{path}:{_tree_digest(path)}"
    return f"tar:{path}:{status.st_size}:{status.st_mtime_ns}"


def _storage_name(reference: str) -> str:
    """ch-image's directory name for an image reference in its storage (`/` as `%`, `:` as `+`)."""
    return reference.replace("/", "%").replace(":", "+")


def image_tree(build: CharliecloudBuild, reference: str) -> str:
    return os.path.join(build.ch_storage, "img", _storage_name(reference))


def _base_record(build: CharliecloudBuild, reference: str) -> str:
    name = hashlib.sha256(reference.encode()).hexdigest()[:32]
    return os.path.join(build.storage_dir, _BASES_RECORD_DIR, name + ".json")


def _held_identity(build: CharliecloudBuild, reference: str) -> Optional[str]:
    """The identity of the base held in storage under `reference` (our record of its import), None when none is."""
    try:
        with open(_base_record(build, reference), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    if record.get("reference") != reference or not os.path.isdir(image_tree(build, reference)):
        return None
    return record.get("identity")


def ensure_base(build: CharliecloudBuild, reference: str, identity: str, log) -> str:
    """Have `reference` in ch-image's storage as `identity` says: kept when it is, else imported (tar, dir) or pulled
    (registry) again; its record is written after, so an import cut short is done again. The action taken."""
    if _held_identity(build, reference) == identity:
        return "kept"
    record = _base_record(build, reference)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record)
    if os.path.isdir(image_tree(build, reference)):
        _ch_image(build, ["delete", reference], log, f"base {reference} changed: ch-image delete {reference}")
    if identity.startswith("registry:"):
        argv, what = ["pull", reference], f"ch-image pull {reference}"
        hint = f"its registry must be reachable from this node, or name a tar or directory for {reference} in " \
               "charliecloud_bases"  # fmt: skip
    else:
        source = build.bases[reference]
        argv, what = ["import", source, reference], f"ch-image import {source} {reference}"
        hint = f"{source} must be a root filesystem tar (optionally compressed) or directory"
    _ch_image(build, argv, log, what, hint)
    os.makedirs(os.path.dirname(record), mode=0o700, exist_ok=True)
    temp = f"{record}.{os.getpid()}.tmp"
    with open(temp, "w", encoding="utf-8") as handle:
        json.dump({"reference": reference, "identity": identity, "imported": time.time()}, handle)
    os.replace(temp, record)
    return "imported" if not identity.startswith("registry:") else "pulled"


def _ch_image(build: CharliecloudBuild, args, log, what: str, hint: str = "", secret_values=()) -> None:
    """Run `ch-image ARGS` into the build log (`log`, open on the file `log.path`); refused naming its last lines."""
    returncode = run_logged(ch_image_argv(args), log, what, build.env, secret_values)
    if returncode != 0:
        log.flush()
        raise CharliecloudError(
            f"{what} failed (exit {returncode})"
            + (f": {hint}" if hint else "")
            + f". Last lines of {log.path}:\n"
            + mask_secrets(build_log_tail(log.path), secret_values)
        )


# --- the build -----------------------------------------------------------------------------------------------------


def charliecloud_plan(plan: ImageBuildPlan, build: CharliecloudBuild) -> ImageBuildPlan:
    """`plan` with its bases' identities (`base_images`) and the fingerprint they complete, for this runtime."""
    identities = {reference: base_identity(reference, build.bases) for reference in plan.base_references}
    counted = dict(identities, **{_RUNTIME_KEY: ",".join(build.mount_points)})
    fingerprint = build_fingerprint(plan.dockerfile, plan.build_args, plan.context_dir, counted)
    return plan._replace(base_images=identities, fingerprint=fingerprint)


def build_tag(plan: ImageBuildPlan) -> str:
    """One tag per image name, kept between builds: the build cache's next build of it starts from this tree."""
    return f"slurm-multi-build-{hashlib.sha256(plan.image_name.encode()).hexdigest()[:24]}"


def ch_image_build_args(plan: ImageBuildPlan, dockerfile: str, secrets_dir: Optional[str]) -> list:
    """ch-image's build arguments (after `ch-image`): the tag, the Dockerfile, the build args, the secrets' bind."""
    args = ["build", "--force", "-t", build_tag(plan), "-f", dockerfile]
    if secrets_dir:
        args += ["-b", f"{secrets_dir}:{SECRETS_TARGET}"]
    for name in sorted(plan.build_args):
        args += ["--build-arg", f"{name}={plan.build_args[name]}"]
    return args + [plan.context_dir]


def build_command(plan: ImageBuildPlan) -> str:
    """The build as the manifest records it (the private Dockerfile copy and secrets dir by their role)."""
    secrets = "<private secrets dir>" if plan.build_secrets else None
    dockerfile = "<Dockerfile without secret mount flags>" if plan.build_secrets else plan.dockerfile
    return "ch-image " + shlex.join(ch_image_build_args(plan, dockerfile, secrets))


def _without_secret_mounts(dockerfile: str, private_dir: str) -> str:
    """A copy of `dockerfile` in `private_dir` with its RUN lines' secret mount flags taken out; other mount kinds
    (cache, bind) are refused: ch-image has none."""
    with open(dockerfile, encoding="utf-8") as handle:
        text = handle.read()

    def _flag(match):
        options = dict(part.partition("=")[::2] for part in match.group(1).split(",") if part)
        kind = options.get("type", "bind").strip("\"'").lower()
        target = (options.get("target") or options.get("dst") or options.get("destination") or "").strip("\"'")
        secret_id = options.get("id", "").strip("\"'") or os.path.basename(target)
        if kind != "secret":
            raise CharliecloudError(
                f"{dockerfile} uses RUN --mount=type={kind}, which ch-image (container_runtime charliecloud) does not "
                "have: use a COPY instead, or build with container_runtime docker"
            )
        if target and target != f"{SECRETS_TARGET}/{secret_id}":
            raise CharliecloudError(
                f"{dockerfile} mounts the secret {secret_id} at {target}; under Charliecloud a build secret is read "
                f"at {SECRETS_TARGET}/{secret_id} only: drop target= (BuildKit's default is the same path)"
            )
        return ""

    copy = os.path.join(private_dir, "Dockerfile")
    with open(copy, "x", encoding="utf-8") as handle:
        handle.write(_SECRET_MOUNT_FLAG.sub(_flag, text))
    return copy


@contextlib.contextmanager
def _build_inputs(plan: ImageBuildPlan):
    """(Dockerfile, secrets dir or None) for ch-image: the plan's own Dockerfile when it mounts nothing, else a private
    copy and a 0700 dir of the secrets (`build_secret_files`) named by id, removed afterwards whatever happened."""
    if not dockerfile_mounts(plan.dockerfile):
        yield plan.dockerfile, None
        return
    private_dir = tempfile.mkdtemp(prefix="slurm-multi-ch-build-", dir=node_local_tmp_dir())
    try:
        dockerfile = _without_secret_mounts(plan.dockerfile, private_dir)
        with build_secret_files(plan.build_secrets, base_dir=private_dir) as files:
            secrets_dir = os.path.join(private_dir, "secrets")
            os.mkdir(secrets_dir, 0o700)
            for secret_id, path in files.items():
                os.rename(path, os.path.join(secrets_dir, secret_id))
            yield dockerfile, secrets_dir
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)


def _open_storage(path: str) -> None:
    """ch-image's storage as this user's own private dir, made where missing: a base or a build tree another user
    planted there would be built into the image and run."""
    descriptor = safe_files.open_private_dir(path)
    if descriptor is None:
        raise CharliecloudError(
            f"{path} (charliecloud_storage_dir) is not this user's own private dir (0700), or another user could "
            "swap it or a dir above it: remove it, or name another in charliecloud_storage_dir"
        )
    os.close(descriptor)


@cache_operation
def ensure_image(cache: CacheDirectory, plan: ImageBuildPlan, build: CharliecloudBuild, force_rebuild=False,
                 check_mode=False):  # fmt: skip
    """Reuse the cache's squashfs built with the plan's fingerprint, else build it with ch-image and publish it
    (not in check mode): (BuildOutcome with image_id sha256:<hex>, the squashfs path or None)."""
    plan = charliecloud_plan(plan, build)
    found = None if force_rebuild else reusable_entry(cache, plan.fingerprint)
    if found is not None:
        key, _ = found
        reason = f"the image cache holds {key}.sqfs with the same build fingerprint"
        return BuildOutcome(plan, "reused", f"sha256:{key}", 0.0, reason), cache.squashfs_path(key)
    reason = "force_rebuild is set" if force_rebuild else "no image in the cache has this build fingerprint"
    if check_mode:
        return BuildOutcome(plan, "would_build", None, 0.0, reason), None
    started = time.monotonic()
    _open_storage(build.storage_dir)
    secret_values = list(plan.build_secrets.values())
    tag = build_tag(plan)
    with open_build_log(plan.log_file) as log:
        log.path = plan.log_file
        for reference, identity in sorted(plan.base_images.items()):
            ensure_base(build, reference, identity, log)
        with _build_inputs(plan) as (dockerfile, secrets_dir):
            args = ch_image_build_args(plan, dockerfile, secrets_dir)
            what = f"model {plan.model['name']}: {build_command(plan)}"
            hint = f"see {plan.dockerfile}"
            _ch_image(build, args, log, what, hint, secret_values)
        tree = image_tree(build, tag)
        details = {
            "mount_points": prepare_tree(tree, build.mount_points),
            "image_name": plan.image_name,
            "model": plan.model["name"],
            "base_images": dict(plan.base_images),
            "base_docker": plan.base_docker,
        }
        key, _ = publish_tree(cache, tree, plan.fingerprint, details, log)
    duration = time.monotonic() - started
    return BuildOutcome(plan, "built", f"sha256:{key}", duration, reason), cache.squashfs_path(key)


def manifest_entry_fields(plan: ImageBuildPlan, squashfs: Optional[str]) -> Dict[str, Any]:
    """What a charliecloud build adds to (or changes in) its build_manifest.json entry."""
    return {
        "container_runtime": "charliecloud",
        "charliecloud_image": squashfs,
        "build_command": build_command(plan),
        # madengine's docker_sha is the base's digest; here what the fingerprint counts of the base.
        "docker_sha": (plan.base_images or {}).get(plan.base_docker, ""),
    }
