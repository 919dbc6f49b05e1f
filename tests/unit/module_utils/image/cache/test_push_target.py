"""The publish's push target, spoken to over HTTP as `docker push` does (the real daemon's pushes are in
test_image_cache.py): what it stores, what it claims and what it refuses, to the daemon and to hostile clients (no
credential or a wrong one, a second writer of one upload, a flood of connections)."""

import base64
import gzip
import hashlib
import http.client
import json
import os
import socket
import threading
import time

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache import push_target
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.push_target import PushTarget

CONFIG = b'{"rootfs": {"diff_ids": []}}'
CONFIG_DIGEST = "sha256:" + hashlib.sha256(CONFIG).hexdigest()


@pytest.fixture
def target(tmp_path):
    with PushTarget(str(tmp_path / "blobs"), CONFIG_DIGEST, upload_cap=1000) as target:
        yield target


def port_of(target):
    return int(target.reference("x").split(":")[1].split("/")[0])


def credential(target):
    """The header the publishing daemon sends (from the private DOCKER_CONFIG publish.py writes)."""
    return {"Authorization": target.authorization}


def request(target, method, path, body=b"", headers=None, authorized=True):
    connection = http.client.HTTPConnection("127.0.0.1", port_of(target), timeout=10)
    connection.request(
        method, path, body=body, headers={**(credential(target) if authorized else {}), **(headers or {})}
    )
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


def test_a_target_that_keeps_no_uploads_checks_them_and_stores_nothing(tmp_path):
    with PushTarget(str(tmp_path / "blobs"), CONFIG_DIGEST, 1000, keep_uploads=False) as target:
        assert upload(target, b"layer bytes") == 201
        assert upload(target, b"torn", digest="sha256:" + "0" * 64) == 400
        assert os.listdir(target.blob_dir) == []


def test_a_served_image_is_pulled_with_the_push_credential_only(target, tmp_path):
    """What teach.py serves: the manifest for any tag, and each blob - bytes, or a part of a file - by its digest."""
    entry = tmp_path / "entry.tar"
    entry.write_bytes(b"header" + b"layer tar" + b"trailer")
    layer_digest = "sha256:" + hashlib.sha256(b"layer tar").hexdigest()
    manifest = json.dumps({"mediaType": "application/vnd.docker.distribution.manifest.v2+json"}).encode()
    target.serve(
        manifest,
        {
            CONFIG_DIGEST: push_target.ServedBlob(data=CONFIG),
            layer_digest: push_target.ServedBlob(path=str(entry), offset=6, size=9),
        },
    )
    repository = f"/v2/{target.repository}"

    assert request(target, "GET", repository + "/manifests/lesson")[::2] == (200, manifest)
    assert request(target, "GET", f"{repository}/blobs/{CONFIG_DIGEST}")[::2] == (200, CONFIG)
    assert request(target, "GET", f"{repository}/blobs/{layer_digest}")[::2] == (200, b"layer tar")
    assert request(target, "GET", f"{repository}/blobs/sha256:{'a' * 64}")[0] == 404
    for path in ("/manifests/lesson", f"/blobs/{layer_digest}"):
        status, _, body = request(target, "GET", repository + path, authorized=False)
        assert status == 401 and b"layer tar" not in body and manifest not in body


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


# -- hostile clients: another local user knows the port and the repository (both in `docker push`'s argv) --------


def blobs_hash_to_their_names(target):
    """Every committed blob's bytes hash to its name ("hashed before linked"), and no upload file is left."""
    names = os.listdir(target.blob_dir)
    for name in names:
        with open(os.path.join(target.blob_dir, name), "rb") as blob:
            assert name.startswith(".") or hashlib.sha256(blob.read()).hexdigest() == name, name
    return names


GUESSED = "Basic " + base64.b64encode(b"slurm-multi-publish:a guess").decode()


@pytest.mark.parametrize("authorization", [None, GUESSED, "Bearer x"])
def test_a_client_without_the_publishs_credential_gets_401_and_nothing_else(target, authorization):
    manifest = json.dumps({"config": {"digest": CONFIG_DIGEST}, "layers": []}).encode()
    repository = f"/v2/{target.repository}"
    headers = {"Authorization": authorization} if authorization else {}
    held = f"{repository}/blobs/sha256:{'a' * 64}"  # a digest the daemon would be told is held
    layer = b"the daemon's layer"
    assert upload(target, layer) == 201
    stored = f"{repository}/blobs/sha256:{hashlib.sha256(layer).hexdigest()}"
    answers = [
        request(target, method, path, body, {**headers, "Content-Length": str(len(body))}, authorized=False)
        for method, path, body in [
            ("GET", "/v2/", b""),
            ("HEAD", held, b""),
            ("HEAD", stored, b""),
            ("POST", repository + "/blobs/uploads/", b""),
            ("PUT", repository + "/manifests/tag", manifest),
        ]
    ]

    for status, answer_headers, _ in answers:
        assert status == 401
        assert answer_headers.get("WWW-Authenticate", "").startswith("Basic realm=")
        assert "Docker-Content-Digest" not in answer_headers and "Location" not in answer_headers
    assert target.manifest is None
    assert len(blobs_hash_to_their_names(target)) == 1  # the daemon's blob alone: no upload slot, no file


def test_a_second_client_cannot_replace_the_daemons_manifest(target):
    path = f"/v2/{target.repository}/manifests/tag"
    ours = json.dumps({"config": {"digest": CONFIG_DIGEST}, "layers": []}).encode()
    forged = json.dumps({"config": {"digest": CONFIG_DIGEST}, "layers": [{"digest": "sha256:" + "f" * 64}]}).encode()
    assert request(target, "PUT", path, ours, {"Content-Length": str(len(ours))})[0] == 201

    status, _, _ = request(target, "PUT", path, forged, {"Content-Length": str(len(forged))}, authorized=False)

    assert status == 401 and target.manifest == json.loads(ours)


def test_a_second_patch_on_an_upload_being_written_is_refused_and_the_blob_hashes_to_its_name(target):
    """Two PATCHes on one upload, one of them chunked and stalled mid-body: the second is answered 416 (the registry
    API's answer to a chunk that does not follow the upload's progress), the first completes, and what is committed
    is exactly the bytes hashed."""
    status, headers, _ = request(target, "POST", f"/v2/{target.repository}/blobs/uploads/")
    location = headers["Location"]
    stalled = socket.create_connection(("127.0.0.1", port_of(target)), timeout=10)
    head = f"PATCH {location} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in credential(target).items())
    first, last = b"A" * 100, b"C" * 100
    stalled.sendall(head.encode() + b"\r\n" + b"%x\r\n%s\r\n" % (len(first), first))
    time.sleep(0.5)  # the first PATCH is inside its body

    second = request(target, "PATCH", location, b"B" * 100, {"Content-Length": "100"})

    stalled.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
    assert stalled.recv(4096).split(b" ")[1] == b"202"
    stalled.close()
    assert (second[0], json.loads(second[2] or b'{"errors": [{}]}')["errors"][0].get("code")) == (
        416,
        "BLOB_UPLOAD_INVALID",
    )
    # The first PATCH's bytes alone, in their order, as hashed.
    digest = "sha256:" + hashlib.sha256(first + last).hexdigest()
    assert request(target, "PUT", f"{location}?digest={digest}")[0] == 201
    assert target.stored == {digest}
    blobs_hash_to_their_names(target)


def test_a_flood_of_idle_connections_piles_up_no_threads_and_keeps_the_daemon_out_of_nothing(target):
    threads_before = threading.active_count()
    bound = push_target.MAX_CONNECTIONS
    flood = [socket.create_connection(("127.0.0.1", port_of(target)), timeout=10) for _ in range(4 * bound)]
    try:
        time.sleep(0.5)
        assert threading.active_count() - threads_before <= bound + 2
        started = time.monotonic()
        assert upload(target, b"the daemon's layer") == 201  # the daemon gets in, as it always sends its credential
        assert time.monotonic() - started < 2
    finally:
        for connection in flood:
            connection.close()


def test_an_idle_connection_is_closed_after_the_socket_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(push_target, "SOCKET_TIMEOUT_SECONDS", 0.5)
    with PushTarget(str(tmp_path / "blobs"), CONFIG_DIGEST, upload_cap=1000) as target:
        idle = socket.create_connection(("127.0.0.1", port_of(target)), timeout=5)
        started = time.monotonic()
        try:
            assert idle.recv(1) == b""  # closed by the target
        except TimeoutError:
            pytest.fail("the target kept an idle connection open for 5 s")
        assert time.monotonic() - started < 3


def test_uploads_past_the_bound_of_open_uploads_are_refused(target):
    bound = push_target.MAX_UPLOADS
    answers = [request(target, "POST", f"/v2/{target.repository}/blobs/uploads/")[0] for _ in range(bound + 1)]

    assert answers == [202] * bound + [429]
    assert len(os.listdir(target.blob_dir)) == bound


def test_an_oversized_manifest_is_refused_and_its_body_left_on_no_connection(target):
    connection = socket.create_connection(("127.0.0.1", port_of(target)), timeout=10)
    size = push_target.MANIFEST_MAX_BYTES + 1
    head = f"PUT /v2/{target.repository}/manifests/tag HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in credential(target).items())
    connection.sendall(head.encode() + b"\r\n" + b"{" + b" " * (size - 1))
    connection.sendall(b"GET /v2/ HTTP/1.1\r\nHost: x\r\n\r\n")  # the next request on this keep-alive connection

    answers = b""
    try:
        while chunk := connection.recv(65536):
            answers += chunk
    except ConnectionResetError:
        pass
    statuses = [line.split(b" ")[1] for line in answers.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]

    assert statuses[0] == b"413" and target.manifest is None
    assert statuses[1:] in ([], [b"200"], [b"401"])  # closed, or the next request read as one: never body bytes


@pytest.mark.parametrize("planted", ["symlink", "group-writable", "other-owner"])
def test_a_blob_dir_that_is_no_private_directory_is_refused(tmp_path, planted):
    blobs = tmp_path / "blobs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if planted == "symlink":
        blobs.symlink_to(elsewhere)
    else:
        blobs.mkdir(mode=0o700)
        if planted == "group-writable":
            blobs.chmod(0o770)
        elif os.geteuid() == 0:
            os.chown(blobs, 65534, 65534)
        else:
            pytest.skip("giving a directory to another user needs root")

    with pytest.raises(Exception, match=str(blobs)) as raised:
        with PushTarget(str(blobs), CONFIG_DIGEST, upload_cap=1000):
            pass

    assert type(raised.value).__name__ == "ImageCacheError"
    assert os.listdir(elsewhere) == []


def test_connections_still_open_when_the_push_ends_are_closed(tmp_path):
    with PushTarget(str(tmp_path / "blobs"), CONFIG_DIGEST, upload_cap=1000) as target:
        idle = socket.create_connection(("127.0.0.1", port_of(target)), timeout=5)
        time.sleep(0.2)

    try:
        assert idle.recv(1) == b""
    except TimeoutError:
        pytest.fail("a connection outlived its push target by 5 s")
