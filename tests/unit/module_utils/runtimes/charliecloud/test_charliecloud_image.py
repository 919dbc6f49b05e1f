"""The Charliecloud image side for real: ch-image builds a busybox-based model image as an ordinary user not in the
docker group, mksquashfs puts it in the shared cache, ch-run runs it in place or from a node-local unpack.

One module-scoped build serves several tests; each later build or unpack is of a tiny tree (well under a second's
work each, a few seconds for the module on this machine)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support import charliecloud as chsupport
from tests.support.ansible import ROOT
from tests.support.users.local_users import HOSTILE, NODOCKER, SYSTEM_PYTHON, TEAM, ensure_user, run_as, setpriv_argv

SECRET = "hf_Zq81wPnotReallyAToken77"
# The Dockerfile names the secret by its digest only: its text goes into the image's history, as under Docker.
DOCKERFILE = (
    "ARG BASE_DOCKER\n"
    "FROM $BASE_DOCKER\n"
    "RUN --mount=type=secret,id=MAD_SECRETS_HF "
    'test "$(sha256sum /run/secrets/MAD_SECRETS_HF | cut -d " " -f 1)" = '
    + hashlib.sha256(SECRET.encode()).hexdigest()
    + " && echo secret-reached-the-build\n"
    "RUN echo model-one > /model.txt\n"
)


def _tools_or_skip() -> None:
    missing = [tool for tool in chsupport.CH_TOOLS if shutil.which(tool, path="/usr/bin:/bin") is None]
    if missing:
        pytest.skip(f"needs Charliecloud and squashfs-tools ({', '.join(missing)} missing)")
    if subprocess.run([SYSTEM_PYTHON, "-c", "import lark"], capture_output=True).returncode != 0:
        pytest.skip("ch-image needs python3-lark for /usr/bin/python3")


def _user_env() -> list:
    return ["env", f"PYTHONPATH={ROOT / 'collections'}", "PATH=/usr/bin:/bin"]


def as_user(command: str, options: dict, prefix=()) -> dict:
    """The support script's `command` run as NODOCKER (optionally under `prefix`, run as root): its JSON answer."""
    argv = [*_user_env(), SYSTEM_PYTHON, chsupport.__file__, command, json.dumps(options)]
    ran = subprocess.run([*prefix, *setpriv_argv(NODOCKER, argv)], capture_output=True, text=True, timeout=300)
    lines = [line for line in ran.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no answer (exit {ran.returncode}): {ran.stdout}\n{ran.stderr}"
    return json.loads(lines[-1])


def ch_run(image: str, command: list, prefix=()) -> subprocess.CompletedProcess:
    argv = setpriv_argv(NODOCKER, ["env", "PATH=/usr/bin:/bin", "ch-run", image, "--", *command])
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=120)


# A private mount namespace where /dev/fuse is /dev/null: a node whose user cannot mount squashfs (root makes it,
# then setpriv drops to the user inside it).
NO_FUSE = (
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount --bind /dev/null /dev/fuse && exec "$@"',
    "-",
)


@pytest.fixture(scope="module")
def lab():
    """A shared place (cache, zoo, base tar) readable by NODOCKER, and that user's node-local storage."""
    _tools_or_skip()
    user = ensure_user(NODOCKER, groups=(TEAM,))
    if "docker" in subprocess.run(["id", "-nG", NODOCKER], capture_output=True, text=True).stdout.split():
        pytest.skip("NODOCKER must not be in the docker group")
    # Not under pytest's tmp dir: root's, 0700, where the user could not reach.
    top = Path(tempfile.mkdtemp(prefix="chtest-shared-", dir="/tmp"))
    top.chmod(0o755)
    shared = top / "shared"
    shared.mkdir()
    chsupport.make_rootfs_tar(top / "rootfs", shared / "base.tar")
    chsupport.write_zoo(shared / "zoo", DOCKERFILE)
    secrets = shared / "secrets.env"
    secrets.write_text(f"MAD_SECRETS_HF={SECRET}\n")
    local = Path("/var/tmp") / f"chtest-{top.name}"
    for path in (shared, local):
        path.mkdir(exist_ok=True)
        subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(path)], check=True)
    secrets.chmod(0o600)
    yield {
        "shared": shared,
        "local": local,
        "options": {
            "zoo": str(shared / "zoo"),
            "cache_dir": str(shared / "cache"),
            "storage_dir": str(local / "storage"),
            "bases": {chsupport.BASE_NAME: str(shared / "base.tar")},
            "log_dir": str(shared / "logs"),
            "secrets_file": str(secrets),
        },
    }
    shutil.rmtree(local, ignore_errors=True)
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def built(lab):
    answer = as_user("build", lab["options"])
    assert "error" not in answer, answer
    return answer


def test_the_build_publishes_one_squashfs_named_by_its_digest(built, lab):
    assert built["action"] == "built"
    key = built["image_id"].split(":", 1)[1]
    assert built["squashfs"] == str(lab["shared"] / "cache" / f"{key}.sqfs")
    marker = json.loads((lab["shared"] / "cache" / f"{key}.json").read_text())
    assert marker["runtime"] == "charliecloud" and marker["build_fingerprint"] == built["fingerprint"]
    assert subprocess.run(["sha256sum", built["squashfs"]], capture_output=True, text=True).stdout.split()[0] == key
    assert ch_run(built["squashfs"], ["cat", "/model.txt"]).stdout.strip() == "model-one"


def test_a_secret_reaches_the_build_and_no_log_or_layer(built, lab, tmp_path):
    log = Path(built["log_file"]).read_text()
    assert "secret-reached-the-build" in log
    assert SECRET not in log
    unpacked = tmp_path / "tree"
    subprocess.run(["unsquashfs", "-q", "-no-progress", "-d", str(unpacked), built["squashfs"]], check=True)
    found = subprocess.run(["grep", "-rl", SECRET, str(unpacked)], capture_output=True, text=True)
    assert found.stdout == "", f"the secret is in the image: {found.stdout}"
    assert not any((unpacked / "run" / "secrets").iterdir())


def test_the_same_inputs_reuse_the_cache_entry_with_no_build(built, lab):
    log = Path(built["log_file"])
    before = log.stat().st_size
    again = as_user("build", lab["options"])
    assert (again["action"], again["image_id"]) == ("reused", built["image_id"])
    assert log.stat().st_size == before, "a reuse ran a build"


def test_a_moved_base_is_rebuilt(built, lab):
    moved = lab["shared"] / "moved-base.tar"
    shutil.copy(lab["shared"] / "base.tar", moved)
    os.chown(moved, *_ids())
    options = dict(lab["options"], bases={chsupport.BASE_NAME: str(moved)})
    answer = as_user("build", options)
    assert answer["action"] == "built", answer
    assert answer["fingerprint"] != built["fingerprint"]
    assert answer["base_images"][chsupport.BASE_NAME].startswith(f"tar:{moved}:")
    assert ch_run(answer["squashfs"], ["cat", "/model.txt"]).stdout.strip() == "model-one"


def test_a_missing_base_is_refused_naming_the_setting(lab):
    options = dict(lab["options"], bases={chsupport.BASE_NAME: str(lab["shared"] / "no-such.tar")})
    answer = as_user("build", options)
    assert answer["error"] == "CharliecloudError"
    assert "charliecloud_bases" in answer["msg"] and "no-such.tar" in answer["msg"]


def test_a_storage_dir_another_user_made_is_refused_before_anything_is_built_in_it(lab):
    # HOSTILE makes the user's ch-image storage first, in a sticky dir both may write: a base planted there would
    # be built into the user's image.
    ensure_user(HOSTILE)
    sticky = Path(tempfile.mkdtemp(prefix="chtest-sticky-", dir="/tmp"))
    sticky.chmod(0o1777)
    try:
        planted = sticky / "storage"
        subprocess.run(setpriv_argv(HOSTILE, ["mkdir", "-m", "0777", str(planted)]), check=True)
        # A base of its own: no cache entry of another test's build is reused, so this one builds.
        base = sticky / "base.tar"
        shutil.copy(lab["shared"] / "base.tar", base)
        base.chmod(0o644)
        bases = {chsupport.BASE_NAME: str(base)}
        answer = as_user("build", dict(lab["options"], storage_dir=str(planted), bases=bases))
        assert answer.get("error") == "CharliecloudError", answer
        assert "charliecloud_storage_dir" in answer["msg"] and str(planted) in answer["msg"]
        assert os.listdir(planted) == []  # nothing imported or built there
    finally:
        shutil.rmtree(sticky, ignore_errors=True)


def _ids():
    import pwd

    user = pwd.getpwnam(NODOCKER)
    return user.pw_uid, user.pw_gid


def test_a_fuse_less_node_unpacks_once_and_runs_the_directory(built, lab):
    unpack_dir = str(lab["local"] / "unpack-nofuse")
    options = {"squashfs": built["squashfs"], "image_id": built["image_id"], "unpack_dir": unpack_dir}
    # The fallback is needed there: ch-run cannot mount the squashfs in that namespace.
    assert ch_run(built["squashfs"], ["true"], prefix=NO_FUSE).returncode != 0
    first = as_user("ready", options, prefix=NO_FUSE)
    assert first["how"] == "unpacked" and "/dev/fuse" in first["why"], first
    assert first["reference"] == os.path.join(unpack_dir, built["image_id"].split(":")[1])
    assert ch_run(first["reference"], ["cat", "/model.txt"], prefix=NO_FUSE).stdout.strip() == "model-one"
    again = as_user("ready", options, prefix=NO_FUSE)
    assert again["how"] == "already-unpacked" and again["bytes"] == 0


def test_a_node_with_fuse_runs_the_shared_file_in_place(built, lab):
    options = {"squashfs": built["squashfs"], "image_id": built["image_id"], "unpack_dir": str(lab["local"] / "u")}
    answer = as_user("ready", options)
    assert (answer["how"], answer["reference"]) == ("in-place", built["squashfs"])
    assert not (lab["local"] / "u").exists()


def test_a_torn_unpack_is_never_run(built, lab):
    """A node died after the unpack's rename but before its completion marker, and another left its temp: the next
    unpack removes both and makes a whole one; the torn directory is never handed out."""
    unpack_dir = lab["local"] / "unpack-torn"
    key = built["image_id"].split(":")[1]
    options = {"squashfs": built["squashfs"], "image_id": built["image_id"], "unpack_dir": str(unpack_dir)}
    run_as(NODOCKER, ["mkdir", "-p", str(unpack_dir / key / "bin")], check=True)
    run_as(NODOCKER, ["sh", "-c", f"echo torn > {unpack_dir / key / 'model.txt'}"], check=True)
    node = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    temp = unpack_dir / f".{key}.{node}.999999.deadbeef.unpack"
    run_as(NODOCKER, ["mkdir", "-p", str(temp)], check=True)
    answer = as_user("ready", dict(options, mountable=False))
    assert answer["how"] == "unpacked", answer
    assert sorted(answer["removed"]) == sorted([str(temp), str(unpack_dir / key)])
    assert ch_run(answer["reference"], ["cat", "/model.txt"]).stdout.strip() == "model-one"
    assert json.loads((unpack_dir / f"{key}.json").read_text())["sha256"] == key


def test_a_foreign_squashfs_is_not_unpacked(built, lab):
    """A file whose bytes are not the identity it is named by (torn, planted) is refused before any unpack."""
    key = "0" * 64
    fake = lab["shared"] / "cache" / f"{key}.sqfs"
    run_as(NODOCKER, ["cp", built["squashfs"], str(fake)], check=True)
    options = {"squashfs": str(fake), "image_id": f"sha256:{key}", "unpack_dir": str(lab["local"] / "u2")}
    answer = as_user("ready", dict(options, mountable=False))
    assert answer["error"] == "ImageCacheError" and "not sha256:" + key in answer["msg"]
    assert not (lab["local"] / "u2" / key).exists()
