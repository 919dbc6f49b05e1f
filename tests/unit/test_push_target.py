"""The publish's push target, spoken to over HTTP as `docker push` does (the real daemon's pushes are in
test_image_cache.py): what it stores, what it claims and what it refuses."""

import gzip
import hashlib
import http.client
import json
import os

import pytest

from ansible.module_utils.image.cache import push_target
from ansible.module_utils.image.cache.push_target import PushTarget

CONFIG = b'{"rootfs": {"diff_ids": []}}'
CONFIG_DIGEST = "sha256:" + hashlib.sha256(CONFIG).hexdigest()


@pytest.fixture
def target(tmp_path):
    with PushTarget(str(tmp_path / "blobs"), CONFIG_DIGEST, upload_cap=1000) as target:
        yield target


def request(target, method, path, body=b"", headers=None):
    port = int(target.reference("x").split(":")[1].split("/")[0])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    answer = (response.status, dict(response.getheaders()), response.read())
    connection.close()
    return answer


def upload(target, data, digest=None, chunked=False):
    repository = f"/v2/{target.repository}"
    status, headers, _ = request(target, "POST", repository + "/blobs/uploads/")
    assert status == 202
    location = headers["Location"]
    body = iter([data]) if chunked else data
    status, headers, _ = request(
        target, "PATCH", location, body, None if chunked else {"Content-Length": str(len(data))}
    )
    if status != 202:
        return status
    digest = digest or "sha256:" + hashlib.sha256(data).hexdigest()
    return request(target, "PUT", f"{location}?digest={digest}")[0]


def test_an_upload_is_stored_under_its_digest_and_then_held(target):
    assert upload(target, b"layer bytes", chunked=True) == 201
    digest = "sha256:" + hashlib.sha256(b"layer bytes").hexdigest()

    assert target.stored == {digest}
    assert open(target.blob_path(digest), "rb").read() == b"layer bytes"
    status, headers, _ = request(target, "HEAD", f"/v2/{target.repository}/blobs/{digest}")
    assert (status, headers["Content-Length"]) == (200, str(len(b"layer bytes")))
    assert [name for name in os.listdir(target.blob_dir) if name.startswith(".")] == []


def test_every_digest_but_the_configs_is_claimed_unless_a_claim_list_is_given(target, tmp_path):
    other = "sha256:" + "a" * 64
    assert request(target, "HEAD", f"/v2/{target.repository}/blobs/{other}")[0] == 200
    assert request(target, "HEAD", f"/v2/{target.repository}/blobs/{CONFIG_DIGEST}")[0] == 404
    with PushTarget(str(tmp_path / "blobs"), CONFIG_DIGEST, 1000, claimed={"sha256:" + "b" * 64}) as listed:
        assert request(listed, "HEAD", f"/v2/{listed.repository}/blobs/{other}")[0] == 404
        assert request(listed, "HEAD", f"/v2/{listed.repository}/blobs/sha256:{'b' * 64}")[0] == 200


def test_bytes_that_do_not_hash_to_the_digest_are_refused_and_not_stored(target):
    assert upload(target, b"torn", digest="sha256:" + "0" * 64) == 400
    assert target.stored == set() and os.listdir(target.blob_dir) == []


def test_uploads_past_the_cap_are_denied(target):
    assert upload(target, b"x" * 600) == 201
    assert upload(target, b"y" * 600) == 403
    assert target.refused


def test_an_upload_of_a_layer_the_cache_holds_is_refused_at_its_first_bytes(tmp_path):
    base = os.urandom(push_target.PREFIX_BYTES) + b"the rest of a base layer" * 1000
    prefixes = {base[: push_target.PREFIX_BYTES]: "sha256:" + "b" * 64}
    with PushTarget(str(tmp_path / "blobs"), CONFIG_DIGEST, 1 << 30, cached_prefixes=prefixes) as target:
        assert upload(target, gzip.compress(os.urandom(200_000))) == 201  # a layer built here
        assert upload(target, CONFIG) == 201  # no gzip: an image config
        assert upload(target, gzip.compress(base)) == 403
        assert (target.refused, target.cached_upload) == (True, "sha256:" + "b" * 64)


def test_another_repository_is_unknown(target):
    status, _, body = request(target, "HEAD", f"/v2/someone-else/blobs/{CONFIG_DIGEST}")
    assert status == 404
    status, _, body = request(target, "POST", "/v2/someone-else/blobs/uploads/")
    assert (status, json.loads(body)["errors"][0]["code"]) == (404, "NAME_UNKNOWN")


def test_the_manifest_is_kept_and_a_malformed_one_refused(target):
    manifest = json.dumps({"config": {"digest": CONFIG_DIGEST}, "layers": []}).encode()
    path = f"/v2/{target.repository}/manifests/tag"
    assert request(target, "PUT", path, manifest, {"Content-Length": str(len(manifest))})[0] == 201
    assert target.manifest["config"]["digest"] == CONFIG_DIGEST
    assert request(target, "PUT", path, b"{not json", {"Content-Length": "9"})[0] == 400
