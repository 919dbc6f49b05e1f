"""The job's secrets file, the container's env file, and masking: secrets reach the container and nothing else."""

import base64
import os
import stat

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.secrets import (
    LINE_BOUNDARIES,
    MASK,
    SecretMasker,
    SecretsError,
    container_env_file,
    format_env_file,
    mask_secrets,
    parse_secrets,
    read_secrets_file,
)
from slurm_multi.submission.secrets import write_secrets_file

VALUE = "hf_Zq8-value-that-must-not-leak"


def _secrets_file(tmp_path, text, mode=0o600):
    path = tmp_path / "secrets.env"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_secrets_file_gives_its_mad_secrets_entries(tmp_path):
    path = _secrets_file(tmp_path, f"# HF\n\nMAD_SECRETS_HFTOKEN={VALUE}\nMAD_SECRETS_DB= a=b c d \n")

    assert read_secrets_file(str(path)) == {"MAD_SECRETS_HFTOKEN": VALUE, "MAD_SECRETS_DB": " a=b c d "}


def test_a_secrets_file_group_or_others_can_read_is_refused_with_the_fix(tmp_path):
    path = _secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={VALUE}\n", mode=0o640)

    with pytest.raises(SecretsError, match=r"mode 0640.*chmod 600"):
        read_secrets_file(str(path))


def test_a_secrets_file_owned_by_someone_else_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file away needs root")
    path = _secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={VALUE}\n")
    os.chown(path, 65534, 65534)

    with pytest.raises(SecretsError, match="owned by uid 65534, not by you"):
        read_secrets_file(str(path))


def test_a_symlink_in_place_of_the_secrets_file_is_refused(tmp_path):
    target = _secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={VALUE}\n")
    link = tmp_path / "link.env"
    link.symlink_to(target)

    with pytest.raises(SecretsError, match="cannot open the secrets file"):
        read_secrets_file(str(link))


def test_a_missing_secrets_file_is_a_clear_error(tmp_path):
    with pytest.raises(SecretsError, match=r"cannot open the secrets file .*absent.env: No such file"):
        read_secrets_file(str(tmp_path / "absent.env"))


def test_a_key_that_is_not_a_mad_secret_is_refused_by_name_and_line():
    with pytest.raises(SecretsError, match=r"line 2: HF_TOKEN is not a MAD_SECRETS_\* name"):
        parse_secrets(f"MAD_SECRETS_A={VALUE}\nHF_TOKEN={VALUE}\n")


def test_a_malformed_line_is_refused_without_showing_it():
    with pytest.raises(SecretsError, match="line 1: expected KEY=VALUE") as raised:
        parse_secrets(f"{VALUE}\n")

    assert VALUE not in str(raised.value)


def test_the_env_file_holds_the_environment_privately_while_the_block_runs(tmp_path):
    with container_env_file({"MAD_SECRETS_HFTOKEN": VALUE, "A": "1"}, base_dir=str(tmp_path)) as path:
        content = open(path).read()
        file_mode = stat.S_IMODE(os.stat(path).st_mode)
        dir_mode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)

    assert content == f"MAD_SECRETS_HFTOKEN={VALUE}\nA=1\n"
    assert (file_mode, dir_mode) == (0o600, 0o700)
    assert os.listdir(tmp_path) == []


def test_the_env_file_is_removed_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with container_env_file({"MAD_SECRETS_HFTOKEN": VALUE}, base_dir=str(tmp_path)):
            raise RuntimeError("docker run failed")

    assert os.listdir(tmp_path) == []


def test_the_env_file_lives_on_node_local_memory_by_default():
    with container_env_file({"A": "1"}) as path:
        assert path.startswith("/dev/shm/slurm-multi-env-")


def test_a_value_an_env_file_cannot_carry_is_refused_without_showing_it():
    with pytest.raises(SecretsError, match="value of MAD_SECRETS_PEM holds a line break") as raised:
        format_env_file({"MAD_SECRETS_PEM": f"{VALUE}\nsecond line"})

    assert VALUE not in str(raised.value)


def test_masking_replaces_every_secret_value_longest_first():
    masked = mask_secrets(f"token {VALUE} and prefix hf_Zq8", [VALUE, "hf_Zq8", ""])

    assert masked == "token ******** and prefix ********"


def test_masking_works_on_raw_log_bytes():
    assert SecretMasker([VALUE]).feed(f"echo {VALUE}\n".encode()) == b"echo ********\n"


@pytest.mark.parametrize("user", ["", "u", "ci", "bot:"])
def test_masking_hides_a_secrets_base64_form_at_any_offset_as_curl_v_prints_basic_auth(user):
    encoded = base64.b64encode(f"{user}:{VALUE}".encode()).decode()
    masked = mask_secrets(f"> Authorization: Basic {encoded}\n", [VALUE])
    left = masked[len("> Authorization: Basic ") :].strip().replace(MASK, "")
    assert MASK in masked and len(left.rstrip("=")) <= 8  # at most the groups the user name and padding share
    assert mask_secrets(base64.b64encode(VALUE.encode()).decode(), [VALUE]).rstrip("=") == MASK


def test_a_secret_cut_between_two_chunks_of_one_long_line_is_masked():
    masker = SecretMasker([VALUE])
    line = b"x" * 100 + VALUE.encode() + b" tail\n"
    written = b"".join(masker.feed(line[start : start + 103]) for start in range(0, len(line), 103))
    assert written + masker.flush() == b"x" * 100 + b"******** tail\n"


def test_held_back_bytes_of_output_that_ends_without_a_newline_come_out_at_the_flush():
    masker = SecretMasker([VALUE])
    assert masker.feed(b"progress 10%") == b""
    assert masker.flush() == b"progress 10%"


# ------------------------------------------------------------------------------------------ short secrets


def test_a_secret_shorter_than_8_characters_in_the_secrets_file_is_refused_by_name(tmp_path):
    path = _secrets_file(tmp_path, f"MAD_SECRETS_HFTOKEN={VALUE}\nMAD_SECRETS_PIN=4242\n")

    with pytest.raises(
        SecretsError,
        match=r"line 2: the secret MAD_SECRETS_PIN is 4 character\(s\) long, shorter "
        r"than 8: masking so short a value would shred the logs",
    ) as raised:
        read_secrets_file(str(path))

    assert "4242" not in str(raised.value)


def test_a_secret_of_8_characters_is_accepted():
    assert parse_secrets("MAD_SECRETS_PIN=12345678\n") == {"MAD_SECRETS_PIN": "12345678"}


def test_the_writer_refuses_a_short_secret_before_the_file_exists(tmp_path):
    with pytest.raises(SecretsError, match="MAD_SECRETS_PIN is 4 character"):
        write_secrets_file(tmp_path, {"MAD_SECRETS_PIN": "4242"})

    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------- what the secrets file can carry


def _splitlines_boundaries():
    return [chr(code) for code in range(0x110000) if len(f"a{chr(code)}b".splitlines()) > 1]


def test_the_line_boundaries_are_exactly_those_str_splitlines_knows():
    assert sorted(LINE_BOUNDARIES) == _splitlines_boundaries()


@pytest.mark.parametrize("boundary", _splitlines_boundaries() + ["\0"], ids=lambda char: f"U+{ord(char):04X}")
def test_the_writer_refuses_every_character_its_reader_splits_lines_on(tmp_path, boundary):
    # Once written, "first<boundary>MAD_SECRETS_OTHER=x" would read back as two secrets, or a cut one.
    with pytest.raises(SecretsError, match="value of MAD_SECRETS_PEM holds a line break") as raised:
        write_secrets_file(tmp_path, {"MAD_SECRETS_PEM": f"{VALUE}{boundary}MAD_SECRETS_OTHER=injected"})

    assert VALUE not in str(raised.value)
    assert list(tmp_path.iterdir()) == []


def test_what_the_writer_accepts_reads_back_unchanged(tmp_path):
    secrets = {"MAD_SECRETS_A": f" {VALUE}\t=#'\"$HOME ", "MAD_SECRETS_B": "# not a comment", "MAD_SECRETS_C": "é" * 8}

    path = write_secrets_file(tmp_path, secrets)

    assert read_secrets_file(str(path)) == secrets
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
