"""Files on shared storage, written and read so that no one else's file or symlink is ever followed (both sides:
standard library only, Python 3.8+)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from typing import Any


def write_file_atomically(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a fresh temp file beside ``path`` (O_EXCL | O_NOFOLLOW: never through anything planted
    there), then rename it to ``path``, replacing whatever is there without following it, and make it durable."""
    directory = os.path.dirname(path) or "."
    temp_path = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    _write_then_rename(temp_path, path, data, mode, durable=True)
    fsync_directory(directory)


def _write_then_rename(temp: str, final: str, data: bytes, mode: int, dir_fd=None, durable=False) -> None:
    """Write ``data`` into the fresh file ``temp`` (never through a file or link planted at its name), then rename
    it to ``final``; with ``durable``, mode ``mode`` whatever the umask, and fsynced first."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temp, flags, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            if durable:
                os.fchmod(handle.fileno(), mode)  # whatever the umask: perf files are for the team's dashboards
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise


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


def write_json_atomically(path: str, data: Any) -> None:
    """Write ``data`` as indented, key-sorted JSON through :func:`write_file_atomically`."""
    write_file_atomically(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_file(path: str, dir_fd: int | None = None) -> bytes:
    """A file's bytes, never through a symlink (ELOOP); a relative ``path`` from the dir ``dir_fd`` when given."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def read_json_file(path: str) -> Any:
    """A JSON file's content, never through a symlink: a link planted in a shared dir must not make us read (and
    keep) another file. OSError when unreadable, ValueError when not JSON."""
    return json.loads(read_file(path).decode("utf-8"))


def read_private_text(path: str, what: str, error: type, if_leaked: str, private: bool = True) -> str:
    """The UTF-8 text of a regular file (O_NOFOLLOW, checked by fstat) that, with `private`, is yours and grants
    nothing to group or others; else `error` naming `what` and the fix (`if_leaked`: what to do with leaked secrets)."""
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# As the kernel's own limit on the links one path resolution follows.
_MAX_LINKS = 40


def open_private_dir(path: str, dir_fd: int | None = None) -> int | None:
    """A descriptor of ``path`` as this user's own private dir (0700), made where missing (the caller closes it); None
    when it is anything else, or when another user could swap it or a dir above it (checked by fstat, O_NOFOLLOW)."""
    uid = os.geteuid()
    names = os.path.abspath(path).split("/") if dir_fd is None else path.split("/")
    walked: list = []  # the names from the start to ``current``, none of them a link
    links = 0
    try:
        current = os.open("/", _DIR_FLAGS) if dir_fd is None else os.dup(dir_fd)
    except OSError:
        return None
    try:
        while names:
            name = names.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                return None  # only in a link's target below dir_fd (an absolute path is normalized)
            above = os.fstat(current)
            if above.st_uid not in (uid, 0):
                return None  # its owner may rename what is in it, sticky or not
            shared = bool(above.st_mode & 0o022)
            if shared and not above.st_mode & stat.S_ISVTX:
                return None  # anyone who may write it may rename the dir below for their own
            try:
                below = _open_or_make_dir(name, current)
            except OSError as err:
                # O_NOFOLLOW | O_DIRECTORY on a link: ENOTDIR (ELOOP without O_DIRECTORY).
                if err.errno not in (errno.ENOTDIR, errno.ELOOP) or dir_fd is not None or links == _MAX_LINKS:
                    raise
                link = os.stat(name, dir_fd=current, follow_symlinks=False)
                if not stat.S_ISLNK(link.st_mode):
                    raise
                if shared and link.st_uid not in (uid, 0):
                    return None  # a link another user planted in a sticky dir
                # Resolved as the kernel would, from / again: every dir of the target is checked in its turn.
                target = os.readlink(name, dir_fd=current)
                names = os.path.normpath(os.path.join("/", *walked, target, *names)).split("/")
                walked, links = [], links + 1
                os.close(current)
                current = -1
                current = os.open("/", _DIR_FLAGS)
                continue
            os.close(current)
            current = below
            walked.append(name)
            if shared and os.fstat(current).st_uid not in (uid, 0):
                return None  # planted in a sticky dir by someone else: theirs to swap
        info = os.fstat(current)
        if info.st_uid != uid or info.st_mode & 0o077:
            return None
        opened, current = current, -1
        return opened
    except OSError:
        return None
    finally:
        if current >= 0:
            os.close(current)


def _open_or_make_dir(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # made by another playbook meanwhile: checked as any found dir is
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def replace_in_dir(dir_fd: int, name: str, data: bytes) -> None:
    """``data`` as ``name`` in the dir open as ``dir_fd``: whole or absent to a reader meanwhile (a fresh temp file
    renamed into place). For a cache: not made durable, as a lost entry is only made again."""
    _write_then_rename(f".part-{secrets.token_hex(8)}", name, data, 0o600, dir_fd=dir_fd)
