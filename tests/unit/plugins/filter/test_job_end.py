"""The running stage's job end: squeue's %e parsed, and the margin before it at which the model is stopped."""

import datetime

import pytest
from ansible.errors import AnsibleFilterError

from plugins.filter.job_end import model_stop_margin, squeue_end_epoch


def _local_epoch(text):
    return int(datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp())


def test_squeue_end_time_is_read_as_the_local_time_epoch():
    assert squeue_end_epoch("2026-11-30T13:00:00") == _local_epoch("2026-11-30T13:00:00")


def test_squeue_end_time_ignores_surrounding_whitespace_and_a_trailing_newline():
    assert squeue_end_epoch("  2026-11-30T13:00:00\n") == _local_epoch("2026-11-30T13:00:00")


def test_a_heterogeneous_jobs_lines_give_the_first_components_end():
    assert squeue_end_epoch("2026-11-30T13:00:00\n2026-11-30T13:00:00\n") == _local_epoch("2026-11-30T13:00:00")


@pytest.mark.parametrize("text", ["NONE", "N/A", "Unknown", "", "\n", None])
def test_a_job_without_a_known_end_has_none(text):
    assert squeue_end_epoch(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "garbage",
        "2026-11-30 13:00:00",
        "30/11/2026T13:00",
        "2026-13-40T25:61:00",
        "slurm_load_jobs error: Invalid job id specified",
    ],
)
def test_garbage_end_time_is_an_error_naming_the_value_and_the_expected_format(text):
    with pytest.raises(AnsibleFilterError) as error:
        squeue_end_epoch(text)
    assert repr(text[:80]) in str(error.value) and "YYYY-MM-DDTHH:MM:SS" in str(error.value)


def test_without_a_known_end_the_margin_is_job_end_margin():
    assert model_stop_margin(None, 240) == 240
    assert model_stop_margin("", "240") == 240


def test_a_long_job_keeps_the_whole_margin():
    assert model_stop_margin(10_000 + 3600, 240, now=10_000) == 240


def test_a_short_job_keeps_a_quarter_of_its_remaining_time():
    assert model_stop_margin(10_000 + 600, 240, now=10_000) == 150


def test_the_quarter_is_whole_seconds():
    assert model_stop_margin(10_000 + 601, 240, now=10_000.5) == 150


def test_the_margin_is_taken_from_the_current_time_by_default():
    end = datetime.datetime.now().timestamp() + 400
    assert model_stop_margin(end, 240) in (99, 100)


@pytest.mark.parametrize("margin", ["four minutes", None, [240]])
def test_a_margin_that_is_not_seconds_is_an_error_naming_job_end_margin(margin):
    with pytest.raises(AnsibleFilterError, match="job_end_margin must be a whole number of seconds"):
        model_stop_margin(None, margin)


def test_a_negative_margin_is_an_error():
    with pytest.raises(AnsibleFilterError, match="must not be negative"):
        model_stop_margin(None, -1)
