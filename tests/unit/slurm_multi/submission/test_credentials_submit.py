"""`submit|run --credentials FILE`: MAD's credential.json checked before anything is written, one entry copied 0600
into the job's private dir, its path alone in the job's vars, the password nowhere in what the command prints."""

import json
import os
import stat
from types import SimpleNamespace

import pytest

from slurm_multi.cli import main
from slurm_multi.submission.credentials import default_credentials_file, write_credentials_copy

PASSWORD = "pw-Zq8-credential-that-must-not-leak"
REGISTRY = "127.0.0.1:17501/ns"


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """Run `slurm-multi ARGS` in this process with HOME at tmp_path/home and the working directory at tmp_path/cwd."""
    for name in ("home", "cwd"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv("SLURM_MULTI_RESULTS_DIR", raising=False)
    for name in [name for name in os.environ if name.startswith(("MAD_SECRETS_", "SLURM_"))]:
        monkeypatch.delenv(name)

    def run(*args):
        try:
            code = main(["submit", "--dry-run", "--nodes", "2", "--tags", "dummy", *args])
        except SystemExit as exc:
            code = exc.code
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run


def _credentials(path, entries=None, mode=0o600):
    entries = entries or {"127.0.0.1:17501": {"username": "lab", "password": PASSWORD}}
    path.write_text(json.dumps({**entries, "MAD_AWS_S3": {"USERNAME": "not ours", "PASSWORD": "s3-secret-xyz"}}))
    path.chmod(mode)
    return path


def _vars_of(dry_run_output):
    after_heading = dry_run_output.split("vars.json (every string marked unsafe for Ansible when written) ----\n", 1)[1]
    return json.loads(after_heading.split("\n# ", 1)[0])


def test_the_job_vars_name_the_private_copy_never_the_users_file_or_the_password(cli, tmp_path):
    credentials = _credentials(tmp_path / "mine.json")
    result = cli("--registry", REGISTRY, "--credentials", str(credentials))
    assert result.returncode == 0, result.stderr
    job_vars = _vars_of(result.stdout)
    assert job_vars["credentials_file"].endswith("/<submission>/credential.json")
    assert PASSWORD not in result.stdout + result.stderr and str(credentials) not in result.stdout
    assert list((tmp_path / "home").rglob("*")) == []


def test_a_credentials_file_others_may_read_is_refused_before_anything_is_written(cli, tmp_path):
    credentials = _credentials(tmp_path / "mine.json", mode=0o644)
    result = cli("--registry", REGISTRY, "--credentials", str(credentials))
    assert result.returncode == 2
    assert f"has mode 0644: group or others may access it; run `chmod 600 {credentials}`" in result.stderr
    assert PASSWORD not in result.stdout + result.stderr and list((tmp_path / "home").rglob("*")) == []


def test_a_credentials_file_of_another_user_is_refused_before_anything_is_written(cli, tmp_path):
    credentials = _credentials(tmp_path / "mine.json")
    os.chown(credentials, 4242, -1)
    result = cli("--registry", REGISTRY, "--credentials", str(credentials))
    assert result.returncode == 2 and "is owned by uid 4242, not by you" in result.stderr
    assert list((tmp_path / "home").rglob("*")) == []


def test_credentials_without_a_registry_are_refused(cli, tmp_path):
    result = cli("--credentials", str(_credentials(tmp_path / "mine.json")))
    assert result.returncode == 2
    assert "is the login of registry mode: give --registry too" in result.stderr


@pytest.mark.parametrize(
    "entry, complaint",
    [
        ({"username": "lab"}, "entry '127.0.0.1:17501': password is missing"),
        ({"username": "lab", "password": ""}, "entry '127.0.0.1:17501': password is empty"),
        ({"user": "lab", "password": PASSWORD}, "entry '127.0.0.1:17501' has unknown field(s) user"),
        ("lab:" + PASSWORD, "entry '127.0.0.1:17501' is a JSON str, not an object"),
    ],
)
def test_a_bad_entry_is_refused_before_anything_is_written_and_never_shown(cli, tmp_path, entry, complaint):
    credentials = _credentials(tmp_path / "mine.json", {"127.0.0.1:17501": entry})
    result = cli("--registry", REGISTRY, "--credentials", str(credentials))
    assert result.returncode == 2
    assert f"the credentials file {credentials}, {complaint}" in result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    assert list((tmp_path / "home").rglob("*")) == []


def test_a_file_without_an_entry_for_the_registry_is_refused_naming_the_key_to_add(cli, tmp_path):
    credentials = _credentials(tmp_path / "mine.json", {"dockerhub": {"username": "u", "password": PASSWORD}})
    result = cli("--registry", REGISTRY, "--credentials", str(credentials))
    assert result.returncode == 2
    assert "has no entry for registry 127.0.0.1:17501 (its entries: 'dockerhub', 'MAD_AWS_S3')" in result.stderr


def test_a_missing_credentials_file_is_refused(cli, tmp_path):
    result = cli("--registry", REGISTRY, "--credentials", str(tmp_path / "nope.json"))
    assert result.returncode == 2 and f"cannot open the credentials file {tmp_path / 'nope.json'}" in result.stderr


def test_mads_credential_json_in_the_current_directory_is_used_for_its_registry(cli, tmp_path):
    _credentials(tmp_path / "cwd" / "credential.json")
    with_entry = cli("--registry", REGISTRY)
    other_registry = cli("--registry", "ghcr.io/org/bench")
    no_registry = cli()
    assert with_entry.returncode == other_registry.returncode == no_registry.returncode == 0
    assert _vars_of(with_entry.stdout)["credentials_file"].endswith("/credential.json")
    assert "credentials_file" not in _vars_of(other_registry.stdout)  # MAD's file holds no login for it
    assert "credentials_file" not in _vars_of(no_registry.stdout)


def test_a_bad_credential_json_in_the_current_directory_is_refused_naming_it(tmp_path):
    (tmp_path / "credential.json").write_text('{"127.0.0.1:17501": {"username": "lab"}}')
    with pytest.raises(Exception, match=r"MAD's, found in the current directory.*password is missing.*--credentials"):
        default_credentials_file(REGISTRY, tmp_path)


def test_the_jobs_copy_is_0600_holds_only_the_registrys_entry_and_is_never_overwritten(tmp_path):
    credentials = _credentials(tmp_path / "mine.json")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    copy = write_credentials_copy(private, credentials, REGISTRY)
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    data = json.loads(copy.read_text())
    assert data["127.0.0.1:17501"] == {"username": "lab", "password": PASSWORD}
    assert "MAD_AWS_S3" not in data and data["slurm-multi:copied-from"] == str(credentials)
    with pytest.raises(FileExistsError):
        write_credentials_copy(private, credentials, REGISTRY)
