"""`submit --wait`'s state lines (slurm_multi/submission/follow.py): where the job ran is said once, even when SLURM
was polled too seldom to see it running."""

from slurm_multi.submission.follow import state_line

RAN = {"NodeList": "node[1-3]", "Reason": "None"}


def test_running_names_the_nodes_and_the_states_after_it_do_not_again():
    assert state_line("7", "RUNNING", RAN, nodes_shown=False) == ("job 7: RUNNING on node[1-3]", True)
    assert state_line("7", "COMPLETED", RAN, nodes_shown=True) == ("job 7: COMPLETED", False)


def test_a_job_shorter_than_the_poll_names_its_nodes_on_the_state_it_was_seen_in():
    # PENDING, then COMPLETED at the next poll: RUNNING never seen (a stand-in job on a fast machine, CI's red).
    assert state_line("7", "PENDING", {"NodeList": "(null)", "Reason": "Priority"}, nodes_shown=False) == (
        "job 7: PENDING (Priority)",
        False,
    )
    assert state_line("7", "COMPLETED", RAN, nodes_shown=False) == ("job 7: COMPLETED on node[1-3]", True)


def test_a_job_that_never_started_names_no_nodes():
    assert state_line("7", "CANCELLED", {"NodeList": "(null)", "Reason": "None"}, nodes_shown=False) == (
        "job 7: CANCELLED",
        False,
    )
    # A requeued job waits again: its old nodes are not where it runs next.
    assert state_line("7", "REQUEUED", RAN, nodes_shown=False) == ("job 7: REQUEUED", False)
