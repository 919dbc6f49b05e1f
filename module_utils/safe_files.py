"""Files on shared storage, written and read so that no one else's file or symlink is ever followed.

Writes go to a fresh temp file (O_CREAT | O_EXCL | O_NOFOLLOW) renamed into place and made durable; reads use
O_NOFOLLOW; a private file (secrets, credentials) is read only when its owner alone may read it.

Node side as well as controller side: standard library only, Python 3.8+.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from typing import Any


def write_file_atomically(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a fresh temp file beside ``path`` (never through a symlink), then rename it to ``path``.

    The temp file is created with O_EXCL | O_NOFOLLOW: a file or symlink planted at its name makes the open fail
    instead of writing through it; the rename replaces whatever is at ``path`` (a symlink too) without following.
    """
    directory = os.path.dirname(path) or "."
    temp_path = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as temp:
            # Whatever the umask: perf files are for the team's dashboards.
            os.fchmod(temp.fileno(), mode)
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        os.replace(temp_path, path)
    except BaseException:
        try:
            os.unlink(temp_path)
        except OSError:
            pass
        raise
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a new name in ``directory`` durable, where the filesystem allows fsync on a directory."""
    # The rename is durable only once the directory is on disk: without this a crash (or an NFS server's) can
    # leave the old file, or none, after the write was reported done.
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return  # a directory we may write but not open (rare): the file itself is on disk
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory (EINVAL): nothing more to do there
    finally:
        os.close(fd)


def write_json_atomically(path: str, data: Any, mode: int = 0o644) -> None:
    """Write ``data`` as indented, key-sorted JSON through :func:`write_file_atomically`."""
    write_file_atomically(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"), mode)


def read_file(path: str) -> bytes:
    """A file's bytes, never through a symlink (ELOOP: an OSError like any unreadable file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def read_json_file(path: str) -> Any:
    """A JSON file's content, never through a symlink: a link planted in a shared dir must not make us read (and
    keep) another file. OSError when unreadable, ValueError when not JSON."""
    return json.loads(read_file(path).decode("utf-8"))


def read_private_text(path: str, what: str, error: type, if_leaked: str, private: bool = True) -> str:
    """The UTF-8 text of a file only its owner may read (a secrets or credentials file), else `error` naming `what`
    ("the secrets file PATH") and the fix.

    Opened with O_NOFOLLOW, then checked with fstat: the checks apply to the very file read, not to what a symlink
    points at later. With `private`, refused unless a regular file owned by the current user that grants nothing
    to group or others - a secret others could read (or replace) is already leaked: `if_leaked` says what to do
    then ("rotate the secrets").
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise error(f"cannot open {what}: {err.strerror}") from None
    with os.fdopen(fd, "r", encoding="utf-8", errors="strict") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} is not a regular file")
        if private and info.st_uid != os.geteuid():
            raise error(
                f"{what} is owned by uid {info.st_uid}, not by you (uid {os.geteuid()}); recreate it as your own user"
            )
        if private and info.st_mode & 0o077:
            raise error(
                f"{what} has mode {stat.S_IMODE(info.st_mode):04o}: group or others may access it; run "
                f"`chmod 600 {path}` (and {if_leaked} if others could read them)"
            )
        try:
            return handle.read()
        except UnicodeDecodeError:
            raise error(f"{what} is not UTF-8 text") from None


def own_private_dir(path: str) -> str | None:
    """``path`` made (0700) or found as this user's own private dir; None when it is anything else."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return None
    mine = stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077
    return path if mine else None
