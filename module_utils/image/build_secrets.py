"""Build secrets: `MAD_SECRETS_*` values reach a Docker build only as BuildKit secret mounts from a 0600 file in a
private node-local dir, never as build args (recorded in the image's history), argv or the CLI's environment."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import is_secret_name, placeholder_names
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import (
    SecretsError,
    node_local_tmp_dir,
    read_secrets_file,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# A `--mount=` flag of a RUN instruction (`RUN --mount=type=secret,id=X,required=true cmd`).
_MOUNT_FLAG = re.compile(r"--mount=(\S+)")


class BuildSecretError(UserError):
    """A secret offered as a build arg, or a mounted secret the job does not provide: the message says the fix."""


def check_build_args(build_args: dict, where: str = "docker_build_arg") -> None:
    """Refuse build args that are, or refer to, `MAD_SECRETS_*` secrets, saying how to mount them instead."""
    for name, value in build_args.items():
        secrets = [name] if is_secret_name(name) else [n for n in placeholder_names(value) if is_secret_name(n)]
        if not secrets:
            continue
        what = f"{where} {name}" + (
            f" refers to {', '.join(secrets)}, a secret" if secrets != [name] else " is a secret"
        )
        secret = secrets[0]
        raise BuildSecretError(
            f"{what}: Docker records build args in the image (docker history, docker inspect) and the image goes "
            f"to the shared cache and registries, so a secret is never passed as a build arg. Remove {name} from "
            f"{where} and read the secret in the Dockerfile from a BuildKit secret mount: "
            f"`RUN --mount=type=secret,id={secret} <command reading /run/secrets/{secret}>` (id={secret}); "
            f"its value comes from the job's secrets file (export {secret} before `slurm-multi submit`)"
        )


def dockerfile_mounts(dockerfile) -> list:
    """The `RUN --mount=` flags of a Dockerfile, each as its options ({"type": "secret", "id": ...})."""
    with open(dockerfile, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    mounts = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for flag in _MOUNT_FLAG.findall(line):
            options = dict(part.partition("=")[::2] for part in flag.split(",") if part)
            mounts.append({key.strip().lower(): value.strip("\"'") for key, value in options.items()})
    return mounts


def secret_mount_ids(mounts: list) -> list:
    """The ids of the secret mounts among `dockerfile_mounts` (BuildKit's default id: the target's basename)."""
    ids = []
    for mount in mounts:
        if mount.get("type") != "secret":
            continue
        target = mount.get("target") or mount.get("dst") or mount.get("destination") or ""
        secret_id = mount.get("id") or os.path.basename(target)
        if secret_id and secret_id not in ids:
            ids.append(secret_id)
    return ids


def build_secrets_for(dockerfile, mounts: list, secrets_file=None) -> dict:
    """{id: value} of the `MAD_SECRETS_*` secrets the Dockerfile mounts, from the job's secrets file; one it lacks
    is refused before anything is built (the build would fail later, less clearly). Other ids are the Dockerfile's."""
    wanted = [secret_id for secret_id in secret_mount_ids(mounts) if is_secret_name(secret_id)]
    if not wanted:
        return {}
    if not secrets_file:
        raise BuildSecretError(
            f"{dockerfile} mounts the build secret {', '.join(wanted)} (RUN --mount=type=secret,id=...) but this "
            f"run has no secrets file: export {' and '.join(wanted)} before `slurm-multi submit` (or give "
            "secrets_file)"
        )
    try:
        secrets = read_secrets_file(str(secrets_file))
    except SecretsError as error:
        raise BuildSecretError(str(error)) from None
    missing = [secret_id for secret_id in wanted if secret_id not in secrets]
    if missing:
        raise BuildSecretError(
            f"{dockerfile} mounts the build secret {', '.join(missing)} (RUN --mount=type=secret,id=...) but the "
            f"job's secrets file {secrets_file} has no {', '.join(missing)}: export it before `slurm-multi submit`"
        )
    return {secret_id: secrets[secret_id] for secret_id in wanted}


@contextlib.contextmanager
def build_secret_files(secrets: dict, base_dir=None):
    """{id: path} of 0600 files holding `secrets`, in a fresh 0700 node-local dir removed afterwards, whatever
    happened (the docker CLI reads a `--secret id=ID,src=PATH` file itself)."""
    if not secrets:
        yield {}
        return
    private_dir = tempfile.mkdtemp(prefix="slurm-multi-build-secrets-", dir=base_dir or node_local_tmp_dir())
    try:
        paths = {}
        for secret_id, value in secrets.items():
            path = os.path.join(private_dir, f"secret-{len(paths)}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as secret_file:
                secret_file.write(value)
            paths[secret_id] = path
        yield paths
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)
