"""The job's stage timeline, its stragglers and the cross-node summary of a figure (module_utils/results/timeline)."""

import math

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import merge_steps
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.timeline import (
    barrier_waits,
    cross_node_summary,
    figure_summary,
    job_timeline,
    last_at_barrier,
    straggler_lines,
    stragglers,
    timeline_table,
)
from plugins.filter.job_layout import node_steps, stage_failure_status

T0 = 1_700_000_000.0


def _steps(**spans):
    return {name: {"start": T0 + start, "end": T0 + end} for name, (start, end) in spans.items()}


# Node 3 loads in 41 s where node 2 takes 2 s, so node 1 and 2 wait at the barrier for it.
TIMELINE = {
    "node1": _steps(build=(0, 5), publish=(5, 8), barrier=(8, 50), container_start=(50, 51), run=(51, 61)),
    "node2": _steps(load=(8, 10), barrier=(10, 50), container_start=(50, 51.2), run=(51.2, 61)),
    "node3": _steps(load=(8, 49), barrier=(49, 50), container_start=(50, 50.9), run=(50.9, 61.1)),
}


def test_merge_steps_keeps_the_steps_module_results_carry_and_drops_the_rest():
    results = [
        None,  # a task that never ran
        {"skipped": True, "changed": False},
        {"step": {"name": "load", "start": T0, "end": T0 + 4}},
        {"step": {"name": "teleport", "start": T0, "end": T0 + 1}},  # no such step
        {"step": {"name": "barrier", "start": T0 + 5, "end": T0 + 4}},  # ends before it starts
        {"step": {"name": "build", "start": "soon", "end": T0}},
    ]
    assert merge_steps(results) == {"load": {"start": T0, "end": T0 + 4}}


def test_the_filter_takes_one_result_or_a_list():
    result = {"step": {"name": "barrier", "start": T0, "end": T0 + 2}}
    assert node_steps(result) == node_steps([None, result]) == {"barrier": {"start": T0, "end": T0 + 2}}


def test_a_rescue_status_keeps_the_steps_so_far_and_the_failed_tasks_own():
    failed = {"failed": True, "msg": "no GO from rank 0", "step": {"name": "barrier", "start": T0 + 4, "end": T0 + 9}}
    status = stage_failure_status(
        "node2", 1, 3, "42", model="dummy", stage="build", failed_result=failed, steps=_steps(load=(0, 4))
    )
    assert status["steps"] == _steps(load=(0, 4), barrier=(4, 9))
    assert set(status) <= set(job_layout.STATUS_FIELDS)


def test_a_rescue_after_a_run_once_loop_names_its_failed_items_error_not_the_loops():
    # The preparation's hand-on sets every node's facts from one worker (a loop over the play's nodes, run once):
    # a bad additional_context fails each item with the filter's error, the task only with "One or more items failed".
    items = [{"item": node, "failed": True, "msg": f"additional_context is not an object ({node})"} for node in "ab"]
    failed = {"failed": True, "msg": "One or more items failed", "results": [{"item": "c", "failed": False}, *items]}
    # A node's own failed item, else the first failed item.
    for node, error_of in (("b", "b"), ("c", "a")):
        status = stage_failure_status(node, 1, 3, "42", stage="preparation", failed_result=failed)
        assert (
            status["reason"]
            == f"the preparation stage failed on {node}: additional_context is not an object ({error_of})"
        )


def test_the_timeline_comes_from_the_statuses_and_ignores_broken_ones():
    statuses = {
        "node1": {"steps": TIMELINE["node1"]},
        "node2": None,  # left no status.json
        "node3": {"steps": {"load": {"start": T0}, "run": TIMELINE["node3"]["run"]}},  # load has no end
    }
    assert job_timeline(statuses) == {
        "node1": TIMELINE["node1"],
        "node2": {},
        "node3": {"run": TIMELINE["node3"]["run"]},
    }


def test_the_slow_loader_is_the_load_straggler_and_the_last_at_the_barrier():
    found = {entry["step"]: entry for entry in stragglers(TIMELINE)}
    load = found["load"]
    assert (load["node"], load["seconds"], load["median_others"], load["ratio"], load["straggler"]) == (
        "node3",
        41.0,
        2.0,
        20.5,
        True,
    )
    assert "barrier" not in found  # who waits longest there came first
    assert last_at_barrier(TIMELINE) == "node3"
    assert barrier_waits(TIMELINE) == {"node1": 42.0, "node2": 40.0, "node3": 1.0}


def test_a_step_done_by_one_node_or_evenly_has_no_straggler():
    found = {entry["step"]: entry for entry in stragglers(TIMELINE)}
    assert found["build"]["nodes"] == 1 and found["build"]["median_others"] is None and not found["build"]["straggler"]
    # run: 10 s, 9.8 s, 10.2 s: the slowest is named, but it is no straggler.
    assert found["run"]["node"] == "node3" and not found["run"]["straggler"]
    # A tiny step twice as slow by a fraction of a second is noise, not a straggler.
    assert not found["container_start"]["straggler"]


def test_the_lines_a_user_reads_name_the_straggler_and_each_barrier_wait():
    lines = straggler_lines(TIMELINE)
    assert "load: node3 took 41.0 s, 20.5x the median of the others (2.0 s)" in lines
    assert "barrier wait: node1 42.0 s, node2 40.0 s, node3 1.0 s" in lines
    assert "barrier: node3 arrived last; the others waited for it" in lines
    assert not any(line.startswith("build:") for line in lines)  # rank 0 alone built


def test_the_table_shows_each_steps_start_and_duration_from_the_first_step():
    table = timeline_table(TIMELINE).splitlines()
    assert table[0].split() == [
        "node",
        "build",
        "(start+s)",
        "publish",
        "(start+s)",
        "load",
        "(start+s)",
        "barrier",
        "(start+s)",
        "container_start",
        "(start+s)",
        "run",
        "(start+s)",
    ]
    assert table[3].split() == ["node3", "-", "-", "8.0+41.0", "49.0+1.0", "50.0+0.9", "50.9+10.2"]
    assert timeline_table({"node1": {}}) == "(no step times recorded)"


def test_the_summary_of_a_figure_has_mean_std_cv_count_and_no_outlier_among_close_values():
    summary = figure_summary({"node1": 100.0, "node2": 102.0, "node3": 98.0})
    assert summary["mean"] == pytest.approx(100.0)
    assert summary["std"] == pytest.approx(2.0)  # the sample standard deviation
    assert summary["cv"] == pytest.approx(0.02)
    assert summary["n_nodes"] == 3 and summary["outliers"] == []
    assert summary["per_node"] == {"node1": 100.0, "node2": 102.0, "node3": 98.0}


def test_a_node_far_from_the_others_is_flagged_as_an_outlier():
    values = {"node1": 100.0, "node2": 101.0, "node3": 99.0, "node4": 100.5, "node5": 60.0}
    assert figure_summary(values)["outliers"] == ["node5"]
    # Equal figures but one: MAD is 0, and a figure 5 % or more away from the median is the outlier.
    assert figure_summary({"a": 10.0, "b": 10.0, "c": 10.0, "d": 12.0})["outliers"] == ["d"]
    assert figure_summary({"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.2})["outliers"] == []


def test_two_nodes_or_one_never_have_an_outlier_and_a_zero_mean_has_no_cv():
    assert figure_summary({"a": 1.0, "b": 100.0})["outliers"] == []
    single = figure_summary({"a": 5.0})
    assert (single["std"], single["n_nodes"], single["outliers"]) == (0.0, 1, [])
    assert figure_summary({"a": -1.0, "b": 1.0})["cv"] is None
    assert figure_summary({})["n_nodes"] == 0


def test_the_cross_node_summary_groups_the_nodes_figures_by_metric():
    summary = cross_node_summary(
        {"node1": {"tokens/s": 10.0}, "node2": {"tokens/s": 14.0, "ms": 3.0}, "node3": {"tokens/s": 12.0}}
    )
    assert summary["tokens/s"]["n_nodes"] == 3 and math.isclose(summary["tokens/s"]["mean"], 12.0)
    assert summary["ms"]["per_node"] == {"node2": 3.0} and summary["ms"]["n_nodes"] == 1


def test_a_short_barrier_names_no_last_arrival():
    quick = {
        "node1": _steps(barrier=(0, 0.4)),
        "node2": _steps(barrier=(0.3, 0.4)),
    }
    assert straggler_lines(quick) == ["barrier wait: node1 0.4 s, node2 0.1 s"]


def test_the_wait_counts_from_when_a_node_was_ready_not_from_its_barrier_task():
    # Push mode: Ansible starts the barrier task on every node once the slowest loader (node3) is done, so the
    # barrier task itself is short everywhere; node1 and node2 waited from the end of their publish and load.
    lockstep = {
        "node1": _steps(publish=(0, 5), barrier=(16.2, 16.4)),
        "node2": _steps(load=(8.9, 9.2), barrier=(16.3, 16.4)),
        "node3": _steps(load=(7.8, 13.8), barrier=(16.3, 16.4)),
    }
    assert barrier_waits(lockstep) == {"node1": 11.4, "node2": 7.2, "node3": 2.6}
    assert last_at_barrier(lockstep) == "node3"
    assert "barrier: node3 arrived last; the others waited for it" in straggler_lines(lockstep)


def test_figures_near_the_float_limit_are_summarised_not_overflowed():
    summary = figure_summary({"node1": 1.7e308, "node2": 1.7e308, "node3": -1.7e308})
    assert summary["median"] == 1.7e308 and summary["outliers"] == ["node3"]
    assert summary["mean"] == pytest.approx(1.7e308 / 3) and summary["std"] is None  # past the float range: no figure
    assert figure_summary({"node1": 10123.4, "node2": 10123.4})["mean"] == 10123.4  # scaling loses no bit
