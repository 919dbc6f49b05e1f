"""This node's module server for one job: runs Ansible's modules as forks of a Python that imported Ansible once.

A push playbook starts one server per node (server_step.py, the module_servers callback); slurm-multi-module-python
hands each pipelined module to it through slurm-multi-module-client, and the server forks a child that takes the
client's environment, working dir, umask and stdout/stderr, runs the payload and exits with its status. docs/speedup.md
says what it does and how it is turned off. Why it is safe:

* Only this user gets in: the socket is in a 0700 dir of this user's, opened without following a link and checked on
  its descriptor by both sides, and each side checks the other's uid (SO_PEERCRED). Another user who took that
  (predictable) dir first is refused; the server then listens in a dir named with the run's key (SERVER_KEY).
* Stale sockets are removed from this user's own dir only, by its descriptor, and only sockets.
* A payload of another Ansible version than the one imported here runs in a fresh Python (the client's fallback);
  the project's module_utils imported here are used only when the payload carries the same source (_ServerImports).
* A signal the client gets is passed on to the module; a client that goes away has its module stopped (SIGTERM,
  then SIGKILL after STOP_GRACE seconds).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
import traceback
import types
import zipfile

STOP_GRACE = 5.0
# Seconds after its last change a dir named with another run's key may be removed, once no server answers in it.
RUN_DIR_SETTLED = 60.0
# The project's module_utils, as the payloads carry them (docs/contracts.md, "Imports").
PROJECT_UTILS = "ansible_collections.slurm_multi.pipeline.plugins.module_utils"
# The modules a push job runs on its nodes (library/), whose module_utils are imported once, here (one missing only
# costs its imports in every module child).
NODE_MODULES = ("node_preflight", "node_facts", "build_images", "image_cache", "registry_pull", "run_model")
# The client's first message: the lengths of its header (JSON) and payload, with its stdout and stderr attached.
PREFIX = struct.Struct("!II")

# The per-run key (server_step.py) naming the dir a server listens in when another user took this user's usual one.
SERVER_KEY = "SLURM_MULTI_MODULE_SERVER_KEY"


# The path rule, the same in slurm-multi-module-client (tests/unit/slurm_multi/speedup/test_module_server.py keeps
# the two equal): the client runs without the project on its path.
def is_private_dir(path: str) -> bool:
    """A directory of this user's, not a link, that no one else may enter (lstat: decides nothing by itself)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def server_dirs(environ=os.environ) -> list:
    """Where this job's server on this node may listen, in order: this user's dir in $SLURM_MULTI_MODULE_SERVER_DIR
    (tests), else a private $XDG_RUNTIME_DIR, else /dev/shm; then that name with the run's key appended, which no
    other user knows, for when another user holds the first."""
    base = environ.get("SLURM_MULTI_MODULE_SERVER_DIR")
    if not base:
        runtime = environ.get("XDG_RUNTIME_DIR", "")
        base = runtime if runtime.startswith("/") and is_private_dir(runtime) else "/dev/shm"
    own = os.path.join(base, f"slurm-multi-modules-{os.getuid()}")
    key = environ.get(SERVER_KEY, "")
    return [own, f"{own}-{key}"] if key.isalnum() and key.isascii() else [own]


def socket_name(environ=os.environ) -> str:
    return f"{environ['SLURM_JOB_ID']}.{environ['SLURMD_NODENAME']}.sock"


def socket_path(environ=os.environ) -> str:
    """Where this job's server listens on this node when this user's usual dir is its own (no other user took it)."""
    return os.path.join(server_dirs(environ)[0], socket_name(environ))


class NotOurs(Exception):
    """A dir the server may not listen in: the reason, for the node's log."""


def _open_private_dir(path: str) -> int:
    """A descriptor of `path` (made if missing), this user's and 0700 by its descriptor; else NotOurs."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise NotOurs(f"{path} cannot be made ({error.strerror})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        try:
            info = os.lstat(path)
        except OSError:
            raise NotOurs(f"{path} cannot be opened ({error.strerror})") from None
        if stat.S_ISLNK(info.st_mode):
            raise NotOurs(f"{path} is a symbolic link") from None
        if info.st_uid != os.getuid():
            raise NotOurs(f"{path} belongs to uid {info.st_uid}") from None
        raise NotOurs(f"{path} cannot be opened as a directory ({error.strerror})") from None
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        if info.st_uid != os.getuid():
            raise NotOurs(f"{path} belongs to uid {info.st_uid}")
        raise NotOurs(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}, not 0700")
    return fd


def _report(message: str) -> None:
    """Once per job and node (a server starts once): the node's syslog, as the client reports, and stderr."""
    import syslog

    syslog.openlog("slurm-multi-module-server", syslog.LOG_PID, syslog.LOG_USER)
    syslog.syslog(syslog.LOG_WARNING, message)
    syslog.closelog()
    print(f"module server: {message}", file=sys.stderr, flush=True)


def _take_server_dir(environ, directories: list) -> tuple:
    """(path, descriptor) of the first of `directories` that is this user's own; the ones refused are reported."""
    refusals = []
    for directory in directories:
        try:
            fd = _open_private_dir(directory)
        except NotOurs as refused:
            refusals.append(str(refused))
            continue
        if refusals:
            # The key stays out of the log: it is the name's one part no other user knows.
            _report(
                f"job {environ['SLURM_JOB_ID']} on {environ['SLURMD_NODENAME']}: " + "; ".join(refusals) + "; "
                f"serving the job's modules in {directories[0]}-<the run's key> instead"
            )
        return directory, fd
    _report(
        f"job {environ['SLURM_JOB_ID']} on {environ['SLURMD_NODENAME']}: " + "; ".join(refusals) + "; "
        "not serving: the job's modules run in a fresh Python"
    )
    raise SystemExit(1)


def _receive_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return bytes(data)


class _PayloadPackages:
    """Meta path finder: a package the server imported (``ansible``) also searches the payload zip's dir of it, for
    what only the payload has (``ansible.legacy.<module>``)."""

    _zip_dirs: dict = {}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        parent = name.rpartition(".")[0]
        package = sys.modules.get(parent)
        search = getattr(package, "__path__", None)
        if not isinstance(search, list):  # a namespace package follows sys.path by itself
            return None
        for entry in sys.path:
            if entry.endswith(".zip") and cls._has_dir(entry, parent.replace(".", "/")):
                where = os.path.join(entry, *parent.split("."))
                if where not in search:
                    search.append(where)
        return None

    @classmethod
    def _has_dir(cls, archive: str, directory: str) -> bool:
        if archive not in cls._zip_dirs:
            try:
                with zipfile.ZipFile(archive) as payload_zip:
                    cls._zip_dirs[archive] = {name.rpartition("/")[0] for name in payload_zip.namelist()}
            except (OSError, zipfile.BadZipFile):
                cls._zip_dirs[archive] = set()
        return directory in cls._zip_dirs[archive]


class _AlreadyImported(importlib.abc.Loader):
    """Loader of a module this server imported: the module as it is, its spec kept."""

    def __init__(self, module: types.ModuleType):
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec


class _ServerImports:
    """Meta path finder, first in a module's child: the project's module_utils imported here stand for the payload's
    own when its zip carries the same source for every one of them (decided once, for all: they import each other)."""

    modules: dict = {}  # name -> (module, the source it was imported from)

    @classmethod
    def import_node_module_utils(cls) -> None:
        cls.modules = _import_node_module_utils()

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in cls.modules:
            return None
        modules, cls.modules = cls.modules, {}
        payload = next((entry for entry in sys.path if entry.endswith(".zip") and os.path.isfile(entry)), None)
        if payload is None or not _carries_the_same_sources(payload, modules):
            return None
        for other, (module, _) in modules.items():
            if hasattr(module, "__path__"):
                module.__path__ = [os.path.join(payload, *other.split("."))]
            sys.modules.setdefault(other, module)
        return importlib.util.spec_from_loader(name, _AlreadyImported(modules[name][0]))


def _carries_the_same_sources(payload: str, modules: dict) -> bool:
    try:
        with zipfile.ZipFile(payload) as payload_zip:
            carried = set(payload_zip.namelist())
            for name, (module, source) in modules.items():
                entry = name.replace(".", "/") + ("/__init__.py" if hasattr(module, "__path__") else ".py")
                if entry in carried and payload_zip.read(entry) != source:
                    return False
    except (OSError, zipfile.BadZipFile):
        return False
    return True


def _import_node_module_utils() -> dict:
    """{name: (module, source)} of the project's module_utils NODE_MODULES import, imported and taken out of
    sys.modules again (a payload must never meet them unasked)."""
    from slurm_multi.paths import project_root

    try:
        library = os.path.join(project_root(), "library")
    except RuntimeError:
        return {}  # no Ansible content beside the package: the modules import their own
    for node_module in NODE_MODULES:
        try:
            with open(os.path.join(library, f"{node_module}.py"), "rb") as source:
                tree = ast.parse(source.read())
        except (OSError, SyntaxError):
            continue  # not there: its modules import their own
        for statement in ast.walk(tree):
            if isinstance(statement, ast.ImportFrom) and (statement.module or "").startswith(PROJECT_UTILS):
                # `from <package> import <module>` names a module too.
                for name in [statement.module] + [f"{statement.module}.{alias.name}" for alias in statement.names]:
                    try:
                        importlib.import_module(name)
                    except Exception:  # noqa: BLE001 - not a module (a name in one), or its import fails: the
                        pass  # modules that need it import their own, as without a server
    imported = {}
    for name in [name for name in sys.modules if name.split(".")[0] == "ansible_collections"]:
        module = sys.modules.pop(name)
        file = getattr(module, "__file__", None) or ""
        if name.startswith(PROJECT_UTILS + ".") and file.endswith(".py"):
            with open(file, "rb") as source:
                imported[name] = (module, source.read())
    return imported


def _run_payload(payload: bytes, header: dict, outputs) -> None:
    """In the module's child: become the client's process (environment, dir, umask, output) and run the payload."""
    os.setsid()  # its own process group: a signal for the server's step reaches the server, the server this child
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, target in zip(outputs, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.close(null)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(header["env"])
    os.umask(header["umask"])
    try:
        os.chdir(header["cwd"])
    except OSError:
        pass  # AnsiballZ goes to the home dir itself when the working dir is gone
    sys.argv = ["/dev/stdin"]
    # The payload is the program now, as in a fresh Python (AnsiballZ reads __main__.__file__).
    program = types.ModuleType("__main__")
    program.__file__ = "/dev/stdin"
    sys.modules["__main__"] = program
    sys.meta_path.insert(0, _PayloadPackages)
    sys.meta_path.insert(0, _ServerImports)
    status = 0
    try:
        exec(compile(payload, "/dev/stdin", "exec"), program.__dict__)
    except SystemExit as leaving:
        code = leaving.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, (int, type(None))):
            print(code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the module's own crash, shown as a fresh Python would show it
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _serve_one(conn: socket.socket, listener: socket.socket) -> None:
    """In a per-client child: check the client, fork the module, pass signals on, and send its exit status."""
    listener.close()
    # This process sees its module through; the server's step ending takes both down anyway.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    prefix, fds, _, _ = socket.recv_fds(conn, PREFIX.size, 2)
    if uid != os.getuid() or len(prefix) != PREFIX.size or len(fds) != 2:
        os._exit(1)
    header_size, payload_size = PREFIX.unpack(prefix)
    header = json.loads(_receive_exactly(conn, header_size))
    payload = _receive_exactly(conn, payload_size)
    if header.get("version") != ANSIBLE_VERSION:
        conn.sendall(b"-")
        os._exit(0)
    conn.sendall(b"+")
    module = os.fork()
    if module == 0:
        conn.close()
        _run_payload(payload, header, fds)
    for fd in fds:
        os.close(fd)
    status, stop_at = None, None
    ended_fd = os.pidfd_open(module)  # readable once the module exited: no polling delay on its status
    while status is None:
        ready, _, _ = select.select([conn, ended_fd], [], [], 1.0)
        if conn in ready:
            data = conn.recv(64)
            if data:
                for number in data:
                    os.kill(module, number)
            elif stop_at is None:  # the client was killed: so is its module, after a grace
                os.kill(module, signal.SIGTERM)
                stop_at = time.monotonic() + STOP_GRACE
        if stop_at is not None and time.monotonic() > stop_at:
            os.kill(module, signal.SIGKILL)
            stop_at = float("inf")
        ended, wait_status = os.waitpid(module, os.WNOHANG)
        if ended:
            status = os.waitstatus_to_exitcode(wait_status)
    try:
        conn.sendall(struct.pack("!i", status if status >= 0 else 128 - status))
    except OSError:
        pass
    os._exit(0)


def _remove_stale_sockets(dir_fd: int) -> None:
    """Remove the sockets no server answers on any more, in this user's dir reached by its descriptor."""
    for name in os.listdir(dir_fd):
        try:
            if not stat.S_ISSOCK(os.lstat(name, dir_fd=dir_fd).st_mode):
                continue
        except OSError:
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(f"/proc/self/fd/{dir_fd}/{name}")
        except ConnectionRefusedError:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        finally:
            probe.close()


def _remove_ended_runs_dirs(own: str, serving_in: str) -> None:
    """Remove this user's dirs named with an ended run's key (a server SIGKILLed with its step leaves its dir), once
    emptied of stale sockets; one changed within RUN_DIR_SETTLED may have a server starting."""
    base, prefix = os.path.split(own)
    try:
        names = [name for name in os.listdir(base) if name.startswith(prefix + "-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        if path == serving_in:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if (
                info.st_uid == os.getuid()
                and not info.st_mode & 0o077
                and time.time() - info.st_mtime > RUN_DIR_SETTLED
            ):
                _remove_stale_sockets(fd)
                os.rmdir(path)
        except OSError:
            pass  # not empty: a server still answers there
        finally:
            os.close(fd)


def serve(environ=os.environ, before_serving=lambda: None) -> None:
    """Listen for this job's modules on this node until signalled, one forked child per client; `before_serving`
    runs once the socket listens (a module sent meanwhile waits rather than starting a fresh Python)."""
    directories = server_dirs(environ)
    directory, dir_fd = _take_server_dir(environ, directories)
    name = socket_name(environ)
    _remove_stale_sockets(dir_fd)
    _remove_ended_runs_dirs(directories[0], directory)
    try:
        if stat.S_ISSOCK(os.lstat(name, dir_fd=dir_fd).st_mode):
            os.unlink(name, dir_fd=dir_fd)  # an earlier server of this job on this node (a requeued job keeps its ID)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Through the dir's descriptor: the dir checked is the dir listened in, and no path length limit applies.
    listener.bind(f"/proc/self/fd/{dir_fd}/{name}")
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        before_serving()
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:
                os.close(dir_fd)
                try:
                    _serve_one(conn, listener)
                except OSError:  # the client went away (killed): its module, if any, was stopped
                    os._exit(1)
            conn.close()
            while True:  # reap the clients' children that ended
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        break
                except ChildProcessError:
                    break
    finally:
        listener.close()
        try:
            os.unlink(name, dir_fd=dir_fd)
            if directory != directories[0]:
                os.rmdir(directory)  # the keyed dir is this run's alone
        except OSError:
            pass  # the next server of this user on this node removes what is left
        os.close(dir_fd)


ANSIBLE_VERSION = ""


def main() -> None:
    global ANSIBLE_VERSION
    from slurm_multi.speedup.switch import off_in

    if off_in(os.environ):
        return  # the speed-up layer is off: every module runs in a fresh Python
    # Import what every module imports, once; payloads must be of this version.
    import ansible.module_utils.basic  # noqa: F401
    from ansible.release import __version__

    from slurm_multi.speedup.ansible_private import import_ansiballz_loader

    import_ansiballz_loader()
    ANSIBLE_VERSION = __version__
    sys.stdout.flush()
    serve(os.environ, before_serving=_ServerImports.import_node_module_utils)


if __name__ == "__main__":
    main()
