"""The submit side of retries (slurm_multi/submission/retry.py): the next submission's node options, the retry
count, sinfo."""

import pytest

from slurm_multi.cli import build_parser
from slurm_multi.errors import SlurmMultiError
from slurm_multi.submission import sbatch
from slurm_multi.submission.retry import checked_retries, options_without
from slurm_multi.submission.sbatch import SlurmOptions

SINFO = """\
node1 allocated lab*
node2 idle lab*
node3 idle lab*
node4 mixed lab*
node5 unknown* lab*
node6 drained lab*
node7 idle* lab*
gpu1 idle gpu
node2 idle gpu
"""


def test_blamed_nodes_join_the_exclude_list_keeping_the_users_own():
    slurm = SlurmOptions(nodes=3, exclude="node[7-8]", job_name="bench", partition="lab", account="a", qos="q")
    retry = options_without(slurm, ["node3"])
    assert retry.exclude == "node7,node8,node3"
    assert (retry.job_name, retry.partition, retry.account, retry.qos) == ("bench", "lab", "a", "q")
    assert retry.validated() == retry


def test_blamed_nodes_leave_the_node_list_and_an_emptied_list_is_dropped():
    assert options_without(SlurmOptions(nodes=2, nodelist="node[1,3]"), ["node3"]).nodelist == "node1"
    assert options_without(SlurmOptions(nodes=2, nodelist="node3"), ["node3"]).nodelist is None


@pytest.mark.parametrize("value", [-1, "1", True, 1.5])
def test_a_retry_count_that_is_not_a_whole_number_is_refused(value):
    with pytest.raises(SlurmMultiError, match="--retries must be a whole number"):
        checked_retries(value)


def test_submit_takes_retries_and_defaults_to_none():
    parser = build_parser()
    assert parser.parse_args(["submit", "--tags", "dummy"]).retries == 0
    assert parser.parse_args(["submit", "--tags", "dummy", "--retries", "2"]).retries == 2


def test_sinfo_usable_nodes_are_the_partitions_up_and_responding_ones():
    assert sbatch.parse_sinfo_nodes(SINFO, None) == ["node1", "node2", "node3", "node4"]
    assert sbatch.parse_sinfo_nodes(SINFO, "gpu") == ["gpu1", "node2"]


def test_the_retry_is_queued_without_the_collect_jobs_slurm_variables_or_secrets(monkeypatch):
    from slurm_multi.submission.retry import _retry_environment

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SBATCH_PARTITION", "other")
    monkeypatch.setenv("SLURM_MULTI_MODE", "pull")
    monkeypatch.setenv("MAD_SECRETS_HFTOKEN", "a-secret-value")
    environment = _retry_environment()
    assert environment["SLURM_MULTI_MODE"] == "pull"
    assert not {"SLURM_JOB_ID", "SBATCH_PARTITION", "MAD_SECRETS_HFTOKEN"} & set(environment)


def test_a_dry_run_says_what_preflight_and_retries_would_do_and_runs_neither(tmp_path, monkeypatch, capsys):
    from slurm_multi.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["submit", "--dry-run", "-N", "2", "--tags", "dummy", "--preflight", "--retries", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "# --preflight: the candidate nodes would be checked first" in out
    assert "# --retries 2: its collect job would resubmit it" in out
    assert "preflight: checking" not in out and not (tmp_path / ".slurm-multi").exists()
