"""Registry credentials: MAD's credential.json checked entry by entry, and a real `docker login` (a private daemon,
a docker-registry with htpasswd auth on loopback) that leaves nothing behind and never shows the password."""

import importlib.util
import json
import os
import socket
import stat
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import push_images
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry import ImageRegistryError, pull_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry_credentials import (
    CredentialsError,
    credential_for,
    logged_in,
    parse_credentials,
    pick_credential,
    private_copy_text,
    read_credentials_file,
    registry_host,
)
from slurm_multi.lab.cluster import registry_answers, registry_config
from tests.support.dockerd import build_busybox_image

ROOT = Path(__file__).resolve().parents[4]
PASSWORD = "pw-Zq8-that-must-not-leak"
SOURCE = "the credentials file /x/credential.json"


def _write(path, data, mode=0o600):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    path.chmod(mode)
    return path


# --- the file and its entries -------------------------------------------------------------------------------------


def test_the_entry_for_the_registry_host_is_picked_among_mads_other_credentials():
    credentials = {
        "dockerhub": {"username": "hub", "password": "hub-password"},
        "localhost:5000": {"username": "me", "password": PASSWORD, "repository": "me/bench"},
        "MAD_AWS_S3": {"USERNAME": "not ours", "PASSWORD": "not ours"},  # MAD's data provider: never checked
        "NAS_NODES": [{"HOST": "nas"}],
    }
    credential = pick_credential(credentials, "localhost:5000/me/bench", SOURCE)
    assert (credential.key, credential.username, credential.secret) == ("localhost:5000", "me", PASSWORD)


@pytest.mark.parametrize("key", ["dockerhub", "docker.io", "index.docker.io", "https://index.docker.io/v1/"])
@pytest.mark.parametrize("registry", ["rocm/pytorch-private", "docker.io/rocm/pytorch-private"])
def test_docker_hub_is_found_under_any_of_its_names(key, registry):
    credential = pick_credential({key: {"username": "u", "token": "dckr_pat_x"}}, registry, SOURCE)
    assert credential.key == key and credential.secret == "dckr_pat_x" and credential.secret_field == "token"


def test_a_key_naming_the_registry_exactly_wins_over_another_for_the_same_host():
    credentials = {
        "ghcr.io": {"username": "a", "password": "p1"},
        "ghcr.io/org/repo": {"username": "b", "password": "p2"},
    }
    assert pick_credential(credentials, "ghcr.io/org/repo", SOURCE).username == "b"


def test_two_entries_for_one_host_are_refused_naming_both():
    credentials = {"ghcr.io": {"username": "a", "password": "p"}, "https://ghcr.io": {"username": "b", "password": "q"}}
    with pytest.raises(
        CredentialsError, match=r"several entries for registry ghcr.io \('ghcr.io', 'https://ghcr.io'\)"
    ):
        pick_credential(credentials, "ghcr.io/org/x", SOURCE)


def test_a_file_without_an_entry_for_the_registry_says_which_key_to_add(tmp_path):
    path = _write(tmp_path / "credential.json", {"dockerhub": {"username": "u", "password": PASSWORD}})
    with pytest.raises(CredentialsError) as error:
        credential_for(str(path), "127.0.0.1:17501/ns")
    message = str(error.value)
    assert "has no entry for registry 127.0.0.1:17501 (its entries: 'dockerhub')" in message
    assert '"127.0.0.1:17501": {"username": "...", "password": "..."}' in message
    assert PASSWORD not in message


@pytest.mark.parametrize(
    "entry, complaint",
    [
        ("u:" + PASSWORD, r"entry 'reg:5000' is a JSON str, not an object"),
        ({"password": PASSWORD}, r"entry 'reg:5000': username is missing"),
        ({"username": " ", "password": PASSWORD}, r"username is empty or not a string"),
        ({"username": "u"}, r"password is missing: give password \(or token\)"),
        ({"username": "u", "password": ""}, r"password is empty or not a string"),
        ({"username": "u", "password": 12345678}, r"password is empty or not a string"),
        ({"username": "u", "token": ""}, r"token is empty or not a string"),
        ({"username": "u", "password": PASSWORD, "token": PASSWORD}, r"has both password and token"),
        ({"username": "u", "pasword": PASSWORD}, r"unknown field\(s\) pasword: .*fix the spelling"),
        ({"username": "u", "password": PASSWORD + "\nx"}, r"password holds a line break"),
        ({"username": "u", "password": PASSWORD, "repository": 3}, r"repository must be a string"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_file_the_key_and_the_fix_never_the_secret(entry, complaint):
    with pytest.raises(CredentialsError, match=complaint) as error:
        pick_credential({"reg:5000": entry}, "reg:5000/ns", SOURCE)
    assert str(error.value).startswith(SOURCE)
    assert PASSWORD not in str(error.value)


@pytest.mark.parametrize(
    "text, complaint",
    [
        ('{"reg:5000": {"username": "u", "password": "' + PASSWORD + '"', r"is not valid JSON \(line 1 column \d+"),
        ('["' + PASSWORD + '"]', r"holds a JSON list, not an object"),
    ],
)
def test_a_file_that_is_not_a_json_object_is_refused_without_its_text(text, complaint):
    with pytest.raises(CredentialsError, match=complaint) as error:
        parse_credentials(text, SOURCE)
    assert PASSWORD not in str(error.value)


def test_a_credentials_file_others_may_read_is_refused_on_the_node_with_the_fix(tmp_path):
    path = _write(tmp_path / "credential.json", {"reg:5000": {"username": "u", "password": PASSWORD}}, mode=0o644)
    with pytest.raises(CredentialsError, match=r"mode 0644.*chmod 600"):
        read_credentials_file(str(path))
    assert read_credentials_file(str(path), private=False)["reg:5000"]["username"] == "u"


def test_a_missing_credentials_file_is_named():
    with pytest.raises(CredentialsError, match=r"cannot open the credentials file /nonexistent/credential.json"):
        read_credentials_file("/nonexistent/credential.json")


def test_the_secret_is_not_in_a_credentials_repr():
    credential = pick_credential({"reg:5000": {"username": "u", "password": PASSWORD}}, "reg:5000", SOURCE)
    assert PASSWORD not in repr(credential) and "password=********" in repr(credential)


def test_the_jobs_copy_holds_one_entry_and_names_the_users_file(tmp_path):
    credential = pick_credential(
        {"reg:5000": {"username": "u", "password": PASSWORD}, "dockerhub": {"username": "x", "password": "y"}},
        "reg:5000",
        SOURCE,
    )
    copy = _write(tmp_path / "copy.json", private_copy_text(credential, "/home/me/MAD/credential.json"))
    data = json.loads(copy.read_text())
    assert set(data) == {"reg:5000", "slurm-multi:copied-from"}
    with pytest.raises(CredentialsError, match=r"the credentials file /home/me/MAD/credential.json \(the job's copy"):
        credential_for(str(copy), "ghcr.io/org/x")


@pytest.mark.parametrize(
    "reference, host",
    [
        ("127.0.0.1:17501/ns@sha256:" + "a" * 64, "127.0.0.1:17501"),
        ("localhost/x:tag", "localhost"),
        ("rocm/pytorch:latest", "docker.io"),
        ("docker.io/rocm/pytorch", "docker.io"),
        ("GHCR.io/org/repo", "ghcr.io"),
    ],
)
def test_the_registry_host_of_an_image_reference(reference, host):
    assert registry_host(reference) == host


# --- a real login: a private daemon, a docker-registry asking for a login ----------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    """`127.0.0.1:PORT` of a docker-registry of this module's own with htpasswd auth (user `me`, PASSWORD)."""
    root = tmp_path_factory.mktemp("auth-registry")
    port = _free_port()
    htpasswd = root / "htpasswd"
    subprocess.run(["htpasswd", "-B", "-i", "-c", str(htpasswd), "me"], input=PASSWORD, text=True, check=True)
    config = root / "config.yml"
    config.write_text(registry_config(root / "storage", "127.0.0.1", port, htpasswd))
    with open(root / "registry.log", "wb") as log:
        process = subprocess.Popen(
            ["/usr/bin/docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while not registry_answers("127.0.0.1", port, login=True):
            assert process.poll() is None and time.monotonic() < deadline, (root / "registry.log").read_text()
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture
def node(private_dockerd, tmp_path, monkeypatch):
    """The private daemon as a node's: DOCKER_HOST set, a HOME of the test's own, node-local storage in tmp_path."""
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    (tmp_path / "shm").mkdir()
    return SimpleNamespace(dockerd=private_dockerd, shm=tmp_path / "shm", home=tmp_path / "home")


def _credentials(tmp_path, registry, password=PASSWORD):
    return str(_write(tmp_path / "credential.json", {registry: {"username": "me", "password": password}}))


def _files_holding(text, root):
    return [str(p) for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_a_login_lives_in_a_private_config_dir_that_is_removed_after_the_block(node, auth_registry, tmp_path):
    with logged_in(_credentials(tmp_path, auth_registry), auth_registry, base_dir=str(node.shm)) as login_env:
        config_dir = login_env["DOCKER_CONFIG"]
        assert os.path.dirname(config_dir) == str(node.shm)
        assert stat.S_IMODE(os.stat(config_dir).st_mode) == 0o700
        assert auth_registry in json.loads((node.shm / config_dir / "config.json").read_text())["auths"]
    assert not os.path.exists(config_dir)
    assert list(node.shm.iterdir()) == []
    assert not (node.home / ".docker").exists()


def test_a_push_and_a_pull_by_digest_through_the_login(node, auth_registry, tmp_path):
    image_id = build_busybox_image(node.dockerd, "ci-login_test", "LABEL login=a\n")
    outcome = SimpleNamespace(plan=SimpleNamespace(image_name="ci-login_test", log_file=str(tmp_path / "l")))
    credentials = _credentials(tmp_path, auth_registry)
    secrets_seen = []

    _, by_digest = push_images([outcome], f"{auth_registry}/ns", credentials, on_secret=secrets_seen.append)
    node.dockerd.docker("image", "rm", "-f", image_id)
    with logged_in(credentials, by_digest["ci-login_test"], base_dir=str(node.shm)) as login_env:
        pulled = pull_image(by_digest["ci-login_test"], login_env=login_env)

    assert secrets_seen == [PASSWORD]  # what a module registers as no_log
    assert pulled.action == "pulled" and pulled.image_id == image_id
    assert _files_holding(PASSWORD, tmp_path) == [credentials]
    assert not (node.home / ".docker").exists()


def test_without_the_login_the_registry_refuses_the_pull(node, auth_registry, tmp_path):
    # The registry really asks for a login: without one the same kind of pull fails.
    with pytest.raises(ImageRegistryError, match=r"credentials_file, `--credentials credential.json`"):
        pull_image(f"{auth_registry}/ns@sha256:{'0' * 64}")


def test_a_wrong_password_fails_naming_the_registry_the_entry_and_the_file_never_the_password(
    node, auth_registry, tmp_path
):
    wrong = "wrong-" + PASSWORD[::-1]
    credentials = _credentials(tmp_path, auth_registry, password=wrong)
    with pytest.raises(CredentialsError) as error:
        with logged_in(credentials, f"{auth_registry}/ns", base_dir=str(node.shm)):
            pytest.fail("logged in with a wrong password")
    message = str(error.value)
    assert f"docker login to registry {auth_registry} as 'me' failed" in message
    assert (
        f"Check the username and password of entry '{auth_registry}' in the credentials file {credentials}" in message
    )
    assert f"this node reaches the registry {auth_registry}" in message
    assert wrong not in message
    assert list(node.shm.iterdir()) == []


def test_the_pull_module_fails_a_wrong_login_naming_the_registry_and_returns_no_password(
    node, auth_registry, tmp_path, capsys
):
    wrong = "wrong-" + PASSWORD[::-1]
    spec = importlib.util.spec_from_file_location("registry_pull", ROOT / "library" / "registry_pull.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = {
        "image": f"{auth_registry}/ns@sha256:{'0' * 64}",
        "credentials_file": _credentials(tmp_path, auth_registry, wrong),
    }
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    out = capsys.readouterr().out
    result = json.loads(out)
    assert result["failed"] and f"docker login to registry {auth_registry} as 'me' failed" in result["msg"]
    assert wrong not in out
