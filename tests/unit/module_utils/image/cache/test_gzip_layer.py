"""The diff ID of a gzip blob, computed as its bytes arrive (module_utils/image/cache/gzip_layer.py): what the push
target, the publish and the load check a blob's layer by."""

import gzip
import hashlib
import os

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.gzip_layer import (
    GzipLayerHash,
    blob_hashes,
)

LAYER = os.urandom(300_000) + b"\0" * 3_000_000  # expands past one inflate step from a small chunk


def fed(data, chunk=7_000, head_bytes=0):
    layer = GzipLayerHash(head_bytes)
    for start in range(0, len(data), chunk):
        layer.feed(data[start : start + chunk])
    return layer


def test_a_layer_fed_in_any_chunks_has_the_sha256_of_its_ungzipped_bytes_and_its_head():
    blob = gzip.compress(LAYER)
    for chunk in (1, 7_000, len(blob)):
        layer = fed(blob[:20_000] if chunk == 1 else blob, chunk, head_bytes=1000)
        if chunk == 1:
            assert layer.diff_id() is None and layer.head == LAYER[:1000]  # not complete yet
        else:
            assert layer.diff_id() == "sha256:" + hashlib.sha256(LAYER).hexdigest()


def test_no_gzip_a_second_member_or_trailing_bytes_have_no_diff_id():
    blob = gzip.compress(LAYER)
    assert fed(b'{"rootfs": {}}').diff_id() is None  # an image config
    assert fed(blob + gzip.compress(b"more")).diff_id() is None
    assert fed(blob + b"x").diff_id() is None
    assert fed(blob[:-1]).diff_id() is None


def test_blob_hashes_reads_a_file_once_for_both_digests(tmp_path):
    blob = gzip.compress(LAYER)
    (tmp_path / "blob").write_bytes(blob)
    assert blob_hashes(str(tmp_path / "blob")) == (
        "sha256:" + hashlib.sha256(blob).hexdigest(),
        "sha256:" + hashlib.sha256(LAYER).hexdigest(),
    )
