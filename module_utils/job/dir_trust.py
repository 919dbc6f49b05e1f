"""The results directory we trust: who may own it and the job dirs in it, and how a job's dirs are made, so others
cannot plant files or symlinks where a job reads and writes its results (docs/contracts.md, "Trust")."""

from __future__ import annotations

import grp
import os
import pwd
import stat

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import JobLayoutError


def user_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def group_name(gid: int) -> str:
    """``name (gid N)``, or ``gid N`` for a gid without a name."""
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def check_directory(path: str, what: str, shared: bool = False) -> None:
    """Refuse a directory where others could plant files for us to read or write through: a symlink, no directory,
    one owned by neither you nor root (a ``shared`` dir, ``records/``, may be a teammate's), or one writable by its
    group or every user without the sticky bit (a team's results dir is ``chgrp TEAM DIR && chmod 3775 DIR``)."""
    try:
        status = os.stat(path) if shared else os.lstat(path)
    except OSError as exc:
        raise JobLayoutError(f"cannot use the {what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(status.st_mode):
        raise JobLayoutError(
            f"the {what} {path} is a symbolic link, which someone else may have planted: remove it and run again"
        )
    if not stat.S_ISDIR(status.st_mode):
        raise JobLayoutError(f"the {what} {path} is not a directory: move it aside or choose another results_dir")
    if not shared and status.st_uid not in (os.geteuid(), 0):
        raise JobLayoutError(
            f"the {what} {path} is owned by {user_name(status.st_uid)}, not by you ({user_name(os.geteuid())}): "
            "its owner controls what is written there. Use a results_dir of your own, or remove it if it is stale"
        )
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not status.st_mode & stat.S_ISVTX:
        writers = "every user" if status.st_mode & stat.S_IWOTH else f"its group {group_name(status.st_gid)}"
        raise JobLayoutError(
            f"the {what} {path} is writable by {writers} without the sticky bit "
            f"(mode {stat.S_IMODE(status.st_mode):04o}): any of them could move what others put there aside and "
            f"plant their own (a job's dir with its ABORT marker, records, perf.csv) or symlinks. "
            f"Fix: chmod 3775 {path} for a team's dir (group-writable, setgid and sticky: each job dir stays its "
            f"owner's), or chmod go-w {path}"
        )


def check_results_dir(results_dir: str, create: bool = False) -> bool:
    """Check the results dir itself and its ``records/`` when there (the results dir created 0755 when missing and
    ``create``); False when missing."""
    if not os.path.lexists(results_dir):
        if not create:
            return False
        try:
            os.makedirs(results_dir, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise JobLayoutError(
                f"cannot create the results directory {results_dir}: {exc.strerror}; results_dir "
                "must be on storage every node and the controller can write"
            ) from None
    if os.path.islink(results_dir):
        # A results_dir given as a symlink (to a scratch filesystem) is the user's own choice: check its target.
        results_dir = os.path.realpath(results_dir)
    check_directory(results_dir, "results directory")
    records = job_layout.records_dir(results_dir)
    if os.path.lexists(records):
        check_directory(records, "records directory", shared=True)
    return True


def make_job_dirs(path: str, results_dir: str) -> None:
    """Create ``path`` (a job, attempt or node dir under ``results_dir``, the user's own, 0755) and check every dir
    on the way; ``records/`` takes the results dir's group write, setgid and sticky bits."""
    check_results_dir(results_dir, create=True)
    relative = os.path.relpath(path, results_dir)
    if relative.startswith(os.pardir) or os.path.isabs(relative):
        raise JobLayoutError(f"{path} is not inside the results directory {results_dir}")
    current = results_dir
    for part in relative.split(os.sep):
        if part in ("", os.curdir):
            continue
        current = os.path.join(current, part)
        shared = current == job_layout.records_dir(results_dir)
        try:
            os.mkdir(current, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise JobLayoutError(
                f"cannot create {current}: {exc.strerror}; the results dir must be writable by you"
            ) from None
        else:
            if shared:
                _share_like_parent(current, results_dir)
        check_directory(current, "records directory" if shared else "job directory", shared=shared)


def _share_like_parent(path: str, parent: str) -> None:
    # A new records/ dir gets the group write, setgid and sticky bits of the results dir, whatever the umask.
    bits = stat.S_IMODE(os.stat(parent).st_mode) & (stat.S_IWGRP | stat.S_ISGID | stat.S_ISVTX)
    if bits:
        try:
            os.chmod(path, 0o755 | bits)
        except OSError:
            pass  # not ours to change (a teammate won the race to create it): it is checked next anyway
