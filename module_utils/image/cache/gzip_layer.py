"""What a gzip-compressed layer (a blob as `docker push` sends it) holds: the sha256 of its bytes ungzipped (the
layer's diff ID) and its first bytes ungzipped, computed as the bytes arrive."""

from __future__ import annotations

import hashlib
import zlib
from typing import Optional

# How much of the ungzipped stream one call makes at most: memory stays bounded whatever a chunk expands to.
INFLATE_STEP_BYTES = 1 << 20


class GzipLayerHash:
    """Fed a blob's bytes as they come, in order: the sha256 of what they ungzip to (`diff_id`), and its first
    `head_bytes` (`head`). A blob that is no single, complete gzip stream (an image config) has no diff ID."""

    def __init__(self, head_bytes: int = 0):
        self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip, as `docker push` sends a layer
        self._digest = hashlib.sha256()
        self._head_bytes = head_bytes
        self.head = b""
        self.gzip = True

    def feed(self, chunk: bytes) -> None:
        if not self.gzip:
            return
        if self._inflate.eof:
            self.gzip = not chunk  # bytes past the stream's end: a second member or trailing data, no one layer
            return
        try:
            while True:
                out = self._inflate.decompress(chunk, INFLATE_STEP_BYTES)
                chunk = self._inflate.unconsumed_tail
                self._digest.update(out)
                if len(self.head) < self._head_bytes:
                    self.head += out[: self._head_bytes - len(self.head)]
                # A full step may leave output pending inside zlib with no input left: ask once more.
                if self._inflate.eof or (not chunk and len(out) < INFLATE_STEP_BYTES):
                    break
        except zlib.error:
            self.gzip = False
            return
        if self._inflate.eof and (chunk or self._inflate.unused_data):
            self.gzip = False  # bytes past the stream's end (kept in either attribute, by Python's version)

    def diff_id(self) -> Optional[str]:
        """The sha256 of the whole stream ungzipped ("sha256:<hex>"), None unless the bytes fed are one gzip stream."""
        if not (self.gzip and self._inflate.eof):
            return None
        return "sha256:" + self._digest.hexdigest()


def blob_hashes(path: str):
    """(the sha256 of the file `path`'s bytes, the diff ID they ungzip to or None): one read of the file."""
    digest, layer = hashlib.sha256(), GzipLayerHash()
    with open(path, "rb") as blob:
        for chunk in iter(lambda: blob.read(INFLATE_STEP_BYTES), b""):
            digest.update(chunk)
            layer.feed(chunk)
    return "sha256:" + digest.hexdigest(), layer.diff_id()
