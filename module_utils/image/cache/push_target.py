"""A push target on this node's loopback: how rank 0's daemon hands the cache only the layers built here.

It answers "held" for every layer digest but the config's, so `docker push` sends the config and the new layers;
it can also serve one image to a pull (`serve`, teach.py). Every local user can reach 127.0.0.1, so every request
must carry this push's random password (given through the CLI's private DOCKER_CONFIG, never argv). An upload is
committed only if it hashes to its digest; past `upload_cap`, or one that repeats a cached layer, is DENIED."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Iterator, NamedTuple, Optional, Set

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    check_cache_dir,
    commit_file,
    create_private_file,
    remove_quietly,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.gzip_layer import GzipLayerHash
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import node_local_tmp_dir

MANIFEST_MAX_BYTES = 4 << 20
# How long a refused request's bytes still in flight are read (see _refuse).
LINGER_SECONDS = 2.0
# How much of an upload, ungzipped, is compared with the layers the cache holds: a layer tar's first file headers
# and contents, which two different layers share only by chance. A layer smaller than this is not worth refusing.
PREFIX_BYTES = 64 << 10
# `docker push` uploads up to 5 layers at once (the daemon's max-concurrent-uploads) and asks about the others on a
# few more connections; these bounds leave it room several times over.
MAX_CONNECTIONS = 32
MAX_UPLOADS = 16
# Longer than the daemon waits between two requests of one push (it keeps a connection for the next HEAD or POST).
SOCKET_TIMEOUT_SECONDS = 60.0
# The user name of the Basic credential (the password is the secret) and the realm the 401 names.
USER = "slurm-multi-publish"
REALM = "slurm-multi publish"
_ROUTE = re.compile(
    r"^/v2/(?P<repository>[a-z0-9-]+)/(?:"
    r"blobs/uploads/(?P<upload>[0-9a-f]*)|blobs/(?P<digest>sha256:[0-9a-f]{64})|manifests/(?P<reference>[\w.-]+)"
    r")/?(?:\?(?P<query>.*))?$"
)
_DIGEST_QUERY = re.compile(r"(?:^|&)digest=sha256(?::|%3A)([0-9a-f]{64})(?:&|$)", re.IGNORECASE)


class ServedBlob(NamedTuple):
    """A blob a pull reads: `size` bytes of file `path` from `offset` (a layer inside an entry's tar), or `data`."""

    path: str = ""
    offset: int = 0
    size: int = 0
    data: bytes = b""

    @property
    def length(self) -> int:
        return self.size if self.path else len(self.data)


class UploadBusy(Exception):
    """Another request is writing this upload."""


class UnknownUpload(Exception):
    """No such upload: never started, committed or dropped."""


class _Upload:
    """One upload: its temporary file, written through this one handle (`lock`: by one request), and its hashes."""

    def __init__(self, path: str):
        self.path = path
        self.file = create_private_file(path)
        self.digest = hashlib.sha256()
        self.layer = GzipLayerHash(PREFIX_BYTES)
        self.size = 0
        self.prefix_checked = False
        self.lock = threading.Lock()


class PushTarget:
    """One push's registry on 127.0.0.1; use as a context manager, push to `reference(tag)` under the environment
    `docker_config()` gives, then read `manifest`, `stored` and `diff_ids`."""

    def __init__(
        self,
        blob_dir: str,
        config_digest: str,
        upload_cap: int,
        claimed: Optional[Set[str]] = None,
        cached_prefixes: Optional[Dict[bytes, str]] = None,
        keep_uploads: bool = True,
    ):
        self.blob_dir = blob_dir
        self.config_digest = config_digest
        self.upload_cap = upload_cap
        # The digests answered "held" without a blob here: every one but the config's, or just these.
        self.claimed = claimed
        # The first PREFIX_BYTES of each layer the cache holds, to its diff ID.
        self.cached_prefixes = cached_prefixes or {}
        # False: a push that only asks which layers the daemon names; its uploads are checked, then dropped.
        self.keep_uploads = keep_uploads
        # The diff ID of a cached layer the daemon began to upload, once refused.
        self.cached_upload: Optional[str] = None
        self.repository = "slurm-multi-publish-" + secrets.token_hex(16)
        # This push's secret: the value of the Authorization header every request must carry.
        credential = f"{USER}:{secrets.token_urlsafe(32)}"
        self._auth = base64.b64encode(credential.encode()).decode()
        self.authorization = "Basic " + self._auth
        self.manifest: Optional[dict] = None
        self.uploaded = 0
        self.refused = False
        self.stored: Set[str] = set()
        # The diff ID each blob this push stored ungzips to (None for one that is no gzip: the image config).
        self.diff_ids: Dict[str, Optional[str]] = {}
        self._uploads: Dict[str, _Upload] = {}
        self._lock = threading.Lock()
        self._server: Optional[_Server] = None
        # What a pull from this target gets (`serve`): one manifest, and blobs by digest.
        self.served_manifest: Optional[bytes] = None
        self.served_blobs: Dict[str, ServedBlob] = {}

    def serve(self, manifest: bytes, blobs: Dict[str, ServedBlob]) -> None:
        """Answer a pull (of any tag, under the same password) with `manifest` and `blobs` (teach.py)."""
        self.served_manifest = manifest
        self.served_blobs = dict(blobs)

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blob_dir, digest.split(":", 1)[1])

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def reference(self, tag: str) -> str:
        return f"{self.host}/{self.repository}:{tag}"

    @contextlib.contextmanager
    def docker_config(self) -> Iterator[Dict[str, str]]:
        """The DOCKER_CONFIG giving the daemon this push's credential: a fresh 0700 node-local dir, removed after."""
        directory = tempfile.mkdtemp(prefix="slurm-multi-push-", dir=node_local_tmp_dir())
        try:
            with create_private_file(os.path.join(directory, "config.json")) as out:
                out.write(json.dumps({"auths": {self.host: {"auth": self._auth}}}).encode())
            yield {"DOCKER_CONFIG": directory}
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> PushTarget:
        # Checked like the cache root, and never through a symlink: an upload is committed into it by name.
        check_cache_dir(self.blob_dir, create=True, follow_symlinks=False)
        self._server = _Server(_handler_for(self))
        # poll_interval: how soon `shutdown` is seen (the default half second would end every publish that late).
        serve = {"poll_interval": 0.05}
        threading.Thread(target=self._server.serve_forever, kwargs=serve, name="push-target", daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._server.hang_up_all()  # the connections still open (idle, or a client's that lingers): their threads end
        for upload in list(self._uploads):
            self._drop(upload)

    def authorized(self, header: Optional[str]) -> bool:
        given = (header or "").encode("latin-1", "replace")
        return hmac.compare_digest(given, self.authorization.encode())

    def start_upload(self) -> Optional[str]:
        """A new upload's name, or None when MAX_UPLOADS are open."""
        upload = secrets.token_hex(16)
        with self._lock:
            if len(self._uploads) >= MAX_UPLOADS:
                return None
            self._uploads[upload] = _Upload(os.path.join(self.blob_dir, f".upload.{upload}.tmp"))
        return upload

    @contextlib.contextmanager
    def writing(self, upload: str) -> Iterator[_Upload]:
        """Upload `upload`, for this request alone: UnknownUpload when there is none, UploadBusy while another
        request writes it. An error inside the block drops it: what was written and hashed may part there."""
        state = self._uploads.get(upload)
        if state is None:
            raise UnknownUpload(upload)
        if not state.lock.acquire(blocking=False):
            raise UploadBusy(upload)
        try:
            if self._uploads.get(upload) is not state:
                raise UnknownUpload(upload)
            try:
                yield state
            except BaseException:
                self._drop(upload)
                raise
        finally:
            state.lock.release()

    def append(self, state: _Upload, chunks) -> int:
        """Append the request body's chunks to the upload (held by `writing`); its size so far. OverflowError (and
        `refused`) past the cap, or as soon as the upload shows itself as a layer the cache holds."""
        for chunk in chunks:
            with self._lock:
                self.uploaded += len(chunk)
                over = self.uploaded > self.upload_cap
            state.layer.feed(chunk)
            cached = None
            if not state.prefix_checked and len(state.layer.head) == PREFIX_BYTES:
                state.prefix_checked = True
                cached = self.cached_prefixes.get(state.layer.head)
            if over or cached:
                self.refused = True
                self.cached_upload = cached
                raise OverflowError
            state.file.write(chunk)
            state.digest.update(chunk)
            state.size += len(chunk)
        return state.size

    def commit(self, upload: str, state: _Upload, digest: str) -> bool:
        """Give the finished upload (held by `writing`) its digest's name; False when its bytes do not hash to
        `digest`. The upload is over either way."""
        with self._lock:
            self._uploads.pop(upload, None)
        try:
            state.file.flush()
            os.fsync(state.file.fileno())
            state.file.close()
            if "sha256:" + state.digest.hexdigest() != digest:
                return False
            if not self.keep_uploads:
                return True
            commit_file(state.path, self.blob_path(digest))  # False: another publisher's copy is there, the same bytes
            with self._lock:
                self.stored.add(digest)
                self.diff_ids[digest] = state.layer.diff_id()
            return True
        finally:
            state.file.close()
            remove_quietly(state.path)

    def drop(self, upload: str) -> bool:
        """Cancel an upload no request is writing (DELETE); False when there is none or one writes it."""
        state = self._uploads.get(upload)
        if state is None or not state.lock.acquire(blocking=False):
            return False
        try:
            self._drop(upload)
            return True
        finally:
            state.lock.release()

    def _drop(self, upload: str) -> None:
        with self._lock:
            state = self._uploads.pop(upload, None)
        if state is not None:
            state.file.close()
            remove_quietly(state.path)


class _Server(ThreadingHTTPServer):
    """The target's HTTP server: one thread per connection, at most MAX_CONNECTIONS; past that the oldest one that
    has shown no password is dropped, so the daemon (which shows it from its second request on) keeps its own."""

    daemon_threads = True
    # The listen backlog: a flood of connections waits there for the accept loop, which drops them, rather than
    # have the kernel drop the daemon's connection (its client retries only after a second).
    request_queue_size = 128

    def __init__(self, handler):
        # Every open connection, oldest first: has it shown the push's credential?
        self._connections: Dict[socket.socket, bool] = {}
        self._guard = threading.Lock()
        super().__init__(("127.0.0.1", 0), handler)

    def process_request(self, request, client_address) -> None:
        with self._guard:
            if len(self._connections) >= MAX_CONNECTIONS:
                unproven = next((c for c, proven in self._connections.items() if not proven), None)
                if unproven is None:
                    self.shutdown_request(request)
                    return
                del self._connections[unproven]
                _hang_up(unproven)  # its thread reads the end of its stream and ends
            self._connections[request] = False
        super().process_request(request, client_address)

    def proven(self, request) -> None:
        with self._guard:
            if request in self._connections:
                self._connections[request] = True

    def hang_up_all(self) -> None:
        with self._guard:
            connections, self._connections = list(self._connections), {}
        for connection in connections:
            _hang_up(connection)

    def close_request(self, request) -> None:
        with self._guard:
            self._connections.pop(request, None)
        super().close_request(request)

    def handle_error(self, request, client_address) -> None:
        pass  # a client gone mid-request, or timed out: a traceback would only fill the module's stderr


def _hang_up(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by its client
        connection.shutdown(socket.SHUT_RDWR)


def _handler_for(target: PushTarget):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = SOCKET_TIMEOUT_SECONDS

        def log_message(self, *args) -> None:
            pass  # the publish reports what it did; per-request lines would only fill the module's stderr

        def parse_request(self) -> bool:
            """The request line and headers; then every request without this push's credential is refused."""
            if not super().parse_request():
                return False
            if target.authorized(self.headers.get("Authorization")):
                self.server.proven(self.connection)
                return True
            self._refuse(401, "UNAUTHORIZED", {"WWW-Authenticate": f'Basic realm="{REALM}"'})
            return False

        def _reply(self, status: int, headers: Optional[dict] = None, error: str = "") -> None:
            body = json.dumps({"errors": [{"code": error, "message": error}]}).encode() if error else b""
            headers = dict(headers or {})
            headers.setdefault("Content-Length", str(len(body)))
            self.send_response(status)
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)

        def _refuse(self, status: int, error: str, headers: Optional[dict] = None) -> None:
            """Answer, then close the connection, reading what the client still sends until it hangs up: closing
            a socket with unread bytes resets it, and the daemon would see a broken request and retry, where a
            DENIED makes it stop at once."""
            self.close_connection = True
            self._reply(status, dict(headers or {}, Connection="close"), error)
            self.wfile.flush()
            with contextlib.suppress(OSError):  # it hung up, or lingered too long: either way it has the answer
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(LINGER_SECONDS)
                while self.connection.recv(CHUNK_BYTES):
                    pass

        def _route(self):
            if self.path.rstrip("/") == "/v2":
                return {}
            match = _ROUTE.match(self.path)
            if match is None or match.group("repository") != target.repository:
                self._refuse(404, "NAME_UNKNOWN")
                return None
            return match.groupdict()

        def _body(self):
            """The request body in chunks, plain or chunked transfer encoding."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return
                    yield from self._exactly(size)
                    self.rfile.readline()
            yield from self._exactly(int(self.headers.get("Content-Length") or 0))

        def _exactly(self, size: int):
            while size:
                chunk = self.rfile.read(min(size, CHUNK_BYTES))
                if not chunk:
                    raise ConnectionError("the request body ended early")
                size -= len(chunk)
                yield chunk

        def do_GET(self) -> None:
            route = self._route()
            if route == {}:
                self._reply(200, {"Content-Type": "application/json", "Content-Length": "2"})
                self.wfile.write(b"{}")
            elif route is None:
                return
            elif route.get("reference") and target.served_manifest is not None:
                self._reply(200, self._manifest_headers())
                self.wfile.write(target.served_manifest)
            elif route.get("digest") in target.served_blobs:
                self._send_blob(target.served_blobs[route["digest"]])
            else:
                self._reply(404, error="MANIFEST_UNKNOWN" if route.get("reference") else "BLOB_UNKNOWN")

        def _manifest_headers(self) -> dict:
            manifest = target.served_manifest
            return {
                "Content-Type": json.loads(manifest)["mediaType"],
                "Content-Length": str(len(manifest)),
                "Docker-Content-Digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
            }

        def _send_blob(self, blob: ServedBlob) -> None:
            self._reply(200, {"Content-Type": "application/octet-stream", "Content-Length": str(blob.length)})
            if not blob.path:
                self.wfile.write(blob.data)
                return
            with open(blob.path, "rb") as source:
                self.wfile.flush()
                self.connection.sendfile(source, blob.offset, blob.length)  # the socket's own loop: it has a timeout

        def do_HEAD(self) -> None:
            route = self._route()
            if route is None:
                return
            digest = route.get("digest")
            if route.get("reference") and target.served_manifest is not None:
                self._reply(200, self._manifest_headers())
            elif not digest:
                self._reply(404 if route else 200)
            elif digest in target.served_blobs:
                self._reply(
                    200, {"Docker-Content-Digest": digest, "Content-Length": str(target.served_blobs[digest].length)}
                )
            elif os.path.exists(target.blob_path(digest)):
                size = os.path.getsize(target.blob_path(digest))
                self._reply(200, {"Docker-Content-Digest": digest, "Content-Length": str(size)})
            elif digest == target.config_digest or (target.claimed is not None and digest not in target.claimed):
                self._reply(404, error="BLOB_UNKNOWN")
            else:
                # A layer the daemon can name: held, as far as this push goes (see the module docstring).
                self._reply(200, {"Docker-Content-Digest": digest, "Content-Length": "0"})

        def do_POST(self) -> None:
            route = self._route()
            if route is None:
                return
            if route.get("upload") != "":
                self._refuse(405, "UNSUPPORTED")
                return
            upload = target.start_upload()
            if upload is None:
                self._refuse(429, "TOOMANYREQUESTS")
                return
            self._reply(202, self._upload_headers(upload, 0))

        def do_PATCH(self) -> None:
            route = self._route()
            if route is None:
                return
            written = self._write(route.get("upload") or "")
            if written is not None:
                self._reply(202, self._upload_headers(route["upload"], written[0]))

        def do_PUT(self) -> None:
            route = self._route()
            if route is None:
                return
            if route.get("reference"):
                self._put_manifest()
                return
            query = _DIGEST_QUERY.search(route.get("query") or "")
            if query is None:
                self._refuse(400, "DIGEST_INVALID")
                return
            digest = "sha256:" + query.group(1).lower()
            written = self._write(route.get("upload") or "", digest)
            if written is None:
                return
            if not written[1]:
                self._reply(400, error="DIGEST_INVALID")
                return
            self._reply(201, {"Docker-Content-Digest": digest, "Location": f"/v2/{target.repository}/blobs/{digest}"})

        def _write(self, upload: str, digest: Optional[str] = None):
            """(size, committed) of `upload` once the body is appended and, given `digest`, committed; else None."""
            try:
                with target.writing(upload) as state:
                    size = target.append(state, self._body())
                    return size, digest is not None and target.commit(upload, state, digest)
            except OverflowError:
                self._refuse(403, "DENIED")
            except UploadBusy:
                self._refuse(416, "BLOB_UPLOAD_INVALID")
            except UnknownUpload:
                self._refuse(404, "BLOB_UPLOAD_UNKNOWN")
            return None

        def do_DELETE(self) -> None:
            route = self._route()
            if route is None:
                return
            if route.get("upload") and target.drop(route["upload"]):
                self._reply(204)
            else:
                self._refuse(404, "BLOB_UPLOAD_UNKNOWN")

        def _put_manifest(self) -> None:
            length = self.headers.get("Content-Length") or ""
            if not length.isdigit() or int(length) > MANIFEST_MAX_BYTES:
                self._refuse(413, "SIZE_INVALID")  # before reading a byte of it
                return
            body = b"".join(self._exactly(int(length)))
            try:
                target.manifest = json.loads(body)
            except ValueError:
                self._reply(400, error="MANIFEST_INVALID")
                return
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            self._reply(201, {"Docker-Content-Digest": digest, "Location": self.path})

        def _upload_headers(self, upload: str, size: int) -> dict:
            return {
                "Location": f"/v2/{target.repository}/blobs/uploads/{upload}",
                "Docker-Upload-UUID": upload,
                "Range": f"0-{max(size - 1, 0)}",
            }

    return Handler
