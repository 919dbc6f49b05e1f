"""A push target on this node's loopback: how rank 0's daemon hands the cache only the layers built here.

`docker save` writes every layer of an image before its first byte (a 1 GB base: 7-10 s for a one-file layer on
it). `docker push` sends a registry only what it lacks: before sending a layer, the daemon asks (HEAD) for a digest it
recorded for that layer - from the pull that brought the base, or an earlier push. This target answers "held" for
every such digest except the image's config, so the daemon sends the config and only the layers it can name by no
digest: those built on this node. Whether a layer the daemon did not send is in the cache is decided afterwards
from the manifest (publish.py). A layer the daemon named but the cache lacks (pushed once to another cache, or its
blob removed as altered) is asked for in a second push, which claims only the digests of layers the cache holds.

Docker trusts a registry on 127.0.0.0/8 without TLS. The target listens on 127.0.0.1 for one push only and answers
under one repository, named by a random nonce: another user of the node cannot upload into the cache. Each upload
goes to a private temporary file, is hashed on the way and committed under its digest (entries.commit_file: two
publishers of one blob write it under its name once). Refused as DENIED, an error the daemon does not retry, so the
publish saves the image whole instead: more than `upload_cap` bytes in all (gzip is several times slower than
`docker save`), and an upload of a layer the cache holds already - one the daemon knows by no digest, such as a base
it got by `docker load` or `docker import`. Such an upload is told by its first PREFIX_BYTES, ungzipped: they are
the first bytes of a layer the cache holds (`cached_prefixes`). That costs a few ms of gzip, where the base would
take a minute per GB.

Only what `docker push` (Docker 20.10 and later) uses of the registry API v2 is served.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional, Set

from ansible.module_utils.image.cache.entries import CHUNK_BYTES, commit_file, create_private_file, remove_quietly

MANIFEST_MAX_BYTES = 4 << 20
# How long a denied upload's bytes still in flight are read (see _deny_mid_body).
LINGER_SECONDS = 2.0
# How much of an upload, ungzipped, is compared with the layers the cache holds: a layer tar's first file headers
# and contents, which two different layers share only by chance. A layer smaller than this is not worth refusing.
PREFIX_BYTES = 64 << 10
_ROUTE = re.compile(
    r"^/v2/(?P<repository>[a-z0-9-]+)/(?:"
    r"blobs/uploads/(?P<upload>[0-9a-f]*)|blobs/(?P<digest>sha256:[0-9a-f]{64})|manifests/(?P<reference>[\w.-]+)"
    r")/?(?:\?(?P<query>.*))?$"
)
_DIGEST_QUERY = re.compile(r"(?:^|&)digest=sha256(?::|%3A)([0-9a-f]{64})(?:&|$)", re.IGNORECASE)


class PushTarget:
    """One push's registry on 127.0.0.1; use as a context manager, push to `reference(tag)`, then read `manifest`."""

    def __init__(
        self,
        blob_dir: str,
        config_digest: str,
        upload_cap: int,
        claimed: Optional[Set[str]] = None,
        cached_prefixes: Optional[Dict[bytes, str]] = None,
    ):
        self.blob_dir = blob_dir
        self.config_digest = config_digest
        self.upload_cap = upload_cap
        # The digests answered "held" without a blob here: every one but the config's, or just these.
        self.claimed = claimed
        # The first PREFIX_BYTES of each layer the cache holds (see the module docstring), to its diff ID.
        self.cached_prefixes = cached_prefixes or {}
        # The diff ID of a cached layer the daemon began to upload, once refused.
        self.cached_upload: Optional[str] = None
        self.repository = "slurm-multi-publish-" + secrets.token_hex(16)
        self.manifest: Optional[dict] = None
        self.uploaded = 0
        self.refused = False
        self.stored: Set[str] = set()
        self._uploads: Dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blob_dir, digest.split(":", 1)[1])

    def reference(self, tag: str) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}/{self.repository}:{tag}"

    def __enter__(self) -> PushTarget:
        os.makedirs(self.blob_dir, mode=0o700, exist_ok=True)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="push-target", daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        for path, *_ in self._uploads.values():
            remove_quietly(path)

    # --- what the handler does, under the lock where uploads are shared -----------------------------------------

    def start_upload(self) -> str:
        upload = secrets.token_hex(16)
        path = os.path.join(self.blob_dir, f".upload.{upload}.tmp")
        with create_private_file(path):
            pass
        with self._lock:
            self._uploads[upload] = (path, hashlib.sha256(), _Prefix())
        return upload

    def has_upload(self, upload: Optional[str]) -> bool:
        return upload in self._uploads

    def append(self, upload: str, chunks) -> int:
        """Append the request body's chunks to `upload`; its size so far. OverflowError (and `refused`) past the
        cap, or as soon as the upload shows itself as a layer the cache holds."""
        path, digest, prefix = self._uploads[upload]
        with open(path, "ab") as out:
            for chunk in chunks:
                with self._lock:
                    self.uploaded += len(chunk)
                    over = self.uploaded > self.upload_cap
                cached = self.cached_prefixes.get(prefix.feed(chunk)) if self.cached_prefixes else None
                if over or cached:
                    self.refused = True
                    self.cached_upload = cached
                    raise OverflowError
                digest.update(chunk)
                out.write(chunk)
            return out.tell()

    def commit(self, upload: str, digest: str) -> bool:
        """Give the finished `upload` its digest's name; False when its bytes do not hash to `digest`."""
        path, hashed, _ = self._uploads.pop(upload)
        try:
            if "sha256:" + hashed.hexdigest() != digest:
                return False
            with open(path, "rb+") as out:
                os.fsync(out.fileno())
            commit_file(path, self.blob_path(digest))  # False: another publisher's copy is there, the same bytes
            with self._lock:
                self.stored.add(digest)
            return True
        finally:
            remove_quietly(path)


class _Prefix:
    """An upload's first PREFIX_BYTES, ungzipped as they arrive; `feed` returns them once complete (then never)."""

    def __init__(self):
        self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip, as `docker push` sends a layer
        self._head = b""
        self._done = False

    def feed(self, chunk: bytes) -> Optional[bytes]:
        if self._done:
            return None
        try:
            self._head += self._inflate.decompress(chunk, PREFIX_BYTES - len(self._head))
        except zlib.error:
            self._done = True  # not gzip (an image config): no layer of the cache
            return None
        if len(self._head) < PREFIX_BYTES and not self._inflate.eof:
            return None
        self._done = True
        return self._head if len(self._head) == PREFIX_BYTES else None


def _handler_for(target: PushTarget):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass  # the publish reports what it did; per-request lines would only fill the module's stderr

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

        def _route(self):
            if self.path.rstrip("/") == "/v2":
                return {}
            match = _ROUTE.match(self.path)
            if match is None or match.group("repository") != target.repository:
                self._reply(404, error="NAME_UNKNOWN")
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
            elif route is not None:
                self._reply(404, error="MANIFEST_UNKNOWN")

        def do_HEAD(self) -> None:
            route = self._route()
            if route is None:
                return
            digest = route.get("digest")
            if not digest:
                self._reply(404 if route else 200)
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
                self._reply(405, error="UNSUPPORTED")
                return
            upload = target.start_upload()
            self._reply(202, self._upload_headers(upload, 0))

        def do_PATCH(self) -> None:
            route = self._route()
            if route and target.has_upload(route.get("upload")):
                upload = route["upload"]
                try:
                    size = target.append(upload, self._body())
                except OverflowError:
                    self._deny_mid_body()
                    return
                self._reply(202, self._upload_headers(upload, size))
            elif route is not None:
                self._reply(404, error="BLOB_UPLOAD_UNKNOWN")

        def do_PUT(self) -> None:
            route = self._route()
            if route is None:
                return
            if route.get("reference"):
                body = b"".join(self._exactly(min(int(self.headers.get("Content-Length") or 0), MANIFEST_MAX_BYTES)))
                try:
                    target.manifest = json.loads(body)
                except ValueError:
                    self._reply(400, error="MANIFEST_INVALID")
                    return
                digest = "sha256:" + hashlib.sha256(body).hexdigest()
                self._reply(201, {"Docker-Content-Digest": digest, "Location": self.path})
                return
            upload, query = route.get("upload"), _DIGEST_QUERY.search(route.get("query") or "")
            if not target.has_upload(upload) or query is None:
                self._reply(404, error="BLOB_UPLOAD_UNKNOWN")
                return
            digest = "sha256:" + query.group(1).lower()
            try:
                target.append(upload, self._body())
            except OverflowError:
                self._deny_mid_body()
                return
            if not target.commit(upload, digest):
                self._reply(400, error="DIGEST_INVALID")
                return
            self._reply(201, {"Docker-Content-Digest": digest, "Location": f"/v2/{target.repository}/blobs/{digest}"})

        def _deny_mid_body(self) -> None:
            """Answer DENIED while the daemon still sends the body, so that it reads the answer (and does not retry).

            Closing a socket with unread bytes resets the connection, and the daemon would see a broken upload,
            which it retries after 5 s: so stop sending, then read what is still in flight until it hangs up.
            """
            self.close_connection = True
            self._reply(403, error="DENIED")
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(LINGER_SECONDS)
                while self.connection.recv(CHUNK_BYTES):
                    pass
            except OSError:
                pass  # it hung up, or lingered too long: either way it has the answer

        def _upload_headers(self, upload: str, size: int) -> dict:
            return {
                "Location": f"/v2/{target.repository}/blobs/uploads/{upload}",
                "Docker-Upload-UUID": upload,
                "Range": f"0-{max(size - 1, 0)}",
            }

    return Handler
