"""Specification of the postprocessing stage: CSV picking, the verdict, records and perf.csv."""

import csv
import errno
import fcntl
import json
import multiprocessing
import os
import stat
import subprocess
import sys

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import (
    FAILURE,
    SUCCESS,
    JobLayoutError,
    new_status,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import (
    collect_job,
    write_failure_record,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_csv import (
    MalformedResultsCsv,
    read_results_csv,
    select_best_results_csv,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import (
    PERF_CSV_COLUMNS,
    _ResultsLock,
    load_record,
    regenerate_perf_csv,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.verdict import (
    NO_METRIC_REASON,
    STATUS_FILE_ERROR,
    decide_verdict,
)
from tests.support.lab.hang_results import HUNG_NODE_REASON, write_hung_job

NODES = ["node1", "node2", "node3"]
MODEL = {"name": "primus_llama", "n_gpus": "8", "tags": ["pyt", "primus"], "args": "--steps 10"}


def clean_status(node, rank, **changes):
    """A status.json of a node whose container ran and exited cleanly."""
    # Through the schema (job_layout.new_status): a field it does not know fails here, as in the run module.
    fields = dict(exit_code=0, started_at=1000.0, ended_at=1100.0)
    fields.update(changes)
    return new_status(node, rank, len(NODES), "42", "primus_llama", **fields)


def clean_statuses(**per_node_changes):
    return {node: clean_status(node, rank, **per_node_changes.get(node, {})) for rank, node in enumerate(NODES)}


def write_node(results_dir, job_id, node, status=None, log=None, files=None, attempt=0):
    """Lay out what one node leaves under <results_dir>/<job_id>/attempt-<attempt>/nodes/<node>/."""
    node_dir = results_dir / job_id / f"attempt-{attempt}" / "nodes" / node
    node_dir.mkdir(parents=True, exist_ok=True)
    if status is not None:
        (node_dir / "status.json").write_text(json.dumps(status))
    if log is not None:
        (node_dir / "run.log").write_text(log)
    for name, text in (files or {}).items():
        (node_dir / name).write_text(text)
    return node_dir


def write_clean_job(results_dir, job_id, metric_on="node3", metric="performance: 10123.4 tok/s\n", attempt=0):
    for rank, node in enumerate(NODES):
        write_node(
            results_dir,
            job_id,
            node,
            clean_status(node, rank),
            log="training\n" + (metric if node == metric_on else ""),
            attempt=attempt,
        )


def read_perf_csv(results_dir):
    with open(results_dir / "perf.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


# ---------------------------------------------------------------------------------------------------------------
# Picking the results CSV


def test_full_worker_csv_beats_an_empty_master_csv(tmp_path):
    master = tmp_path / "master.csv"
    master.write_text("model,performance,metric\n")
    worker = tmp_path / "worker.csv"
    worker.write_text("model,performance,metric\nllama,10.1,tok/s\nllama_b,522,TFLOPS\n")
    best, _ = select_best_results_csv([str(master), str(worker)])
    assert best == str(worker)


def test_csv_with_more_non_empty_performance_cells_wins_over_one_with_more_rows(tmp_path):
    sparse = tmp_path / "sparse.csv"
    sparse.write_text("model,performance,metric\na,,x\nb, ,x\nc,1,x\n")
    dense = tmp_path / "dense.csv"
    dense.write_text("model,performance,metric\na,1,x\nb,2,x\n")
    assert select_best_results_csv([str(sparse), str(dense)])[0] == str(dense)


def test_tie_on_non_empty_cells_goes_to_the_csv_with_more_rows(tmp_path):
    short = tmp_path / "short.csv"
    short.write_text("model,performance,metric\na,1,x\n")
    longer = tmp_path / "longer.csv"
    longer.write_text("model,performance,metric\na,1,x\nb,,x\n")
    assert select_best_results_csv([str(short), str(longer)])[0] == str(longer)


def test_full_tie_goes_to_the_first_candidate_given(tmp_path):
    paths = []
    for name in ("rank0.csv", "rank1.csv"):
        (tmp_path / name).write_text("model,performance,metric\na,1,x\n")
        paths.append(str(tmp_path / name))
    assert select_best_results_csv(paths)[0] == paths[0]
    assert select_best_results_csv(paths[::-1])[0] == paths[1]


def test_leading_space_headers_still_name_the_columns(tmp_path):
    spaced = tmp_path / "spaced.csv"
    spaced.write_text("model, performance , metric\nllama,  10.1  , tok/s \n")
    best, report = select_best_results_csv([str(spaced)])
    assert best == str(spaced)
    assert report[0]["non_empty_rows"] == 1


def test_only_empty_candidates_select_nothing(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("model,performance,metric\nllama,,tok/s\n")
    best, report = select_best_results_csv([str(empty)])
    assert best is None
    assert report[0]["rows"] == 1 and report[0]["non_empty_rows"] == 0


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "empty file"),
        (b"model,metric\nllama,tok/s\n", "missing column(s) performance"),
        (b"model,performance,metric, performance\na,1,x,2\n", "duplicate column(s) performance"),
        (b"model,performance,metric\n\xff\xfe\x00\x01,1,x\n", "not UTF-8"),
    ],
)
def test_malformed_csv_is_skipped_and_reported_with_why(tmp_path, content, why):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(content)
    good = tmp_path / "good.csv"
    good.write_text("model,performance,metric\na,1,x\n")
    best, report = select_best_results_csv([str(bad), str(good)])
    assert best == str(good)
    assert report[0]["path"] == str(bad) and why in report[0]["skipped"]


def test_missing_candidate_file_is_reported_as_unreadable(tmp_path):
    best, report = select_best_results_csv([str(tmp_path / "gone.csv")])
    assert best is None
    assert "unreadable" in report[0]["skipped"]


def test_best_csv_that_cannot_be_parsed_whole_gives_way_to_the_next_best(tmp_path):
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("model,performance,metric\na,1,x\nb,2,x\nc,3,x,surplus\n")
    fine = tmp_path / "fine.csv"
    fine.write_text("model,performance,metric\na,1,x\n")
    best, report = select_best_results_csv([str(ragged), str(fine)])
    assert best == str(fine)
    assert "unparsable" in report[0]["skipped"]


def test_results_csv_is_read_stripped_with_its_extra_columns(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text(" model , performance,metric, batch_size\n llama , 10.1 ,tok/s , 32 \n")
    frame = read_results_csv(str(path))
    assert frame.to_dict(orient="records") == [
        {"model": "llama", "performance": "10.1", "metric": "tok/s", "batch_size": "32"}
    ]


def test_reading_a_malformed_csv_raises_with_why(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("name,value\n")
    with pytest.raises(MalformedResultsCsv, match="missing column"):
        read_results_csv(str(path))


# ---------------------------------------------------------------------------------------------------------------
# The verdict

METRIC = [{"model": "primus_llama", "performance": "10123.4", "metric": "tok/s"}]


@pytest.mark.parametrize(
    "changes, cause",
    [
        ({"status": FAILURE, "exit_code": 1, "reason": "exit 1"}, "container exited with code 1"),
        ({"status": FAILURE, "error_pattern": "RuntimeError:"}, "log matched error pattern 'RuntimeError:'"),
        ({"status": FAILURE, "cancelled": True, "exit_code": 143}, "cancelled"),
        ({"status": FAILURE, "timed_out": True, "exit_code": 137}, "timed out"),
        (
            {"status": FAILURE, "exit_code": None, "reason": "docker run refused the image"},
            "node reported FAILURE: docker run refused the image",
        ),
    ],
)
def test_failure_on_one_node_fails_the_job_although_another_printed_a_metric(changes, cause):
    verdict = decide_verdict(clean_statuses(node2=changes), METRIC, NODES)
    assert verdict.status == FAILURE
    assert cause in verdict.reason and "node2 (rank 1)" in verdict.reason
    assert verdict.per_node["node2"]["status"] == FAILURE
    assert verdict.per_node["node1"]["status"] == SUCCESS


def test_node_without_status_file_is_a_failure_named_in_the_reason():
    statuses = clean_statuses()
    statuses["node3"] = None
    verdict = decide_verdict(statuses, METRIC, NODES)
    assert verdict.status == FAILURE
    assert "no status.json" in verdict.reason and "node3 (rank 2)" in verdict.reason


def test_expected_node_absent_from_the_statuses_is_a_failure():
    statuses = clean_statuses()
    del statuses["node2"]
    verdict = decide_verdict(statuses, METRIC, NODES)
    assert verdict.status == FAILURE and "node2 (rank 1)" in verdict.reason


def test_unreadable_status_file_is_a_failure_saying_so():
    statuses = clean_statuses()
    statuses["node1"] = {STATUS_FILE_ERROR: "Expecting value: line 1 column 1"}
    verdict = decide_verdict(statuses, METRIC, NODES)
    assert verdict.status == FAILURE and "status.json unreadable" in verdict.reason


def test_aborted_nodes_are_reported_after_the_rank_that_failed():
    statuses = clean_statuses(
        node1={"status": FAILURE, "aborted_by_rank": 1, "exit_code": 137},
        node2={"status": FAILURE, "exit_code": 1},
        node3={"status": FAILURE, "aborted_by_rank": 1, "exit_code": 137},
    )
    verdict = decide_verdict(statuses, [], NODES)
    assert verdict.reason.startswith("node2 (rank 1): container exited with code 1; ")
    assert "node1 (rank 0), node3 (rank 2): stopped because rank 1 failed" in verdict.reason
    assert verdict.per_node["node2"]["root_cause"] and not verdict.per_node["node1"]["root_cause"]


def test_blamed_rank_without_status_is_the_root_cause_with_the_abort_markers_reason():
    statuses = clean_statuses(node1={"status": FAILURE, "aborted_by_rank": 2})
    statuses["node3"] = None
    marker = {"rank": 2, "node": "node3", "reason": "container exited with code 139"}
    verdict = decide_verdict(statuses, [], NODES, abort_marker=marker)
    assert verdict.per_node["node3"]["root_cause"]
    assert verdict.reason.index("node3 (rank 2)") < verdict.reason.index("node1 (rank 0)")


def test_blamed_rank_whose_status_looks_clean_is_still_the_root_cause():
    statuses = clean_statuses(node1={"status": FAILURE, "aborted_by_rank": 2})
    verdict = decide_verdict(statuses, METRIC, NODES, abort_marker={"rank": 2, "reason": "NCCL timeout"})
    assert verdict.per_node["node3"]["status"] == FAILURE
    assert "node3 (rank 2): failed and stopped the other ranks: NCCL timeout" in verdict.reason


def test_abort_marker_alone_fails_a_job_whose_nodes_all_look_clean():
    verdict = decide_verdict(clean_statuses(), METRIC, NODES, abort_marker={"rank": 7, "reason": "lost rank"})
    assert verdict.status == FAILURE and "lost rank" in verdict.reason


def test_metric_printed_only_by_the_last_rank_on_a_worker_is_a_success():
    verdict = decide_verdict(clean_statuses(node3={"perf_lines": 1}), METRIC, NODES)
    assert verdict.status == SUCCESS
    assert all(entry["status"] == SUCCESS for entry in verdict.per_node.values())


def test_clean_run_without_any_metric_is_a_failure():
    verdict = decide_verdict(clean_statuses(), [{"model": "m", "performance": " ", "metric": "x"}], NODES)
    assert (verdict.status, verdict.reason) == (FAILURE, NO_METRIC_REASON)


def test_failed_run_without_metric_says_both():
    verdict = decide_verdict(clean_statuses(node1={"exit_code": 2}), [], NODES)
    assert verdict.reason.endswith("; " + NO_METRIC_REASON)


def test_container_that_never_ran_is_a_failure():
    verdict = decide_verdict(clean_statuses(node2={"exit_code": None}), METRIC, NODES)
    assert "never ran" in verdict.per_node["node2"]["reason"]


def test_same_cause_on_many_nodes_is_one_readable_clause():
    nodes = [f"gpu{i:03d}" for i in range(64)]
    statuses = {node: clean_status(node, rank, status=FAILURE, cancelled=True) for rank, node in enumerate(nodes)}
    verdict = decide_verdict(statuses, [], nodes)
    assert verdict.reason.count("cancelled") == 1
    assert "and 56 more" in verdict.reason


def test_job_with_no_node_at_all_is_a_failure():
    verdict = decide_verdict({}, [], [])
    assert verdict.status == FAILURE and "no node" in verdict.reason


# ---------------------------------------------------------------------------------------------------------------
# Collecting a job: records and perf.csv


def test_collect_writes_the_record_the_job_csv_and_perf_csv(tmp_path):
    write_clean_job(tmp_path, "42")
    collection = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    assert collection.changed
    assert collection.record["status"] == SUCCESS
    assert json.loads((tmp_path / "records" / "42.json").read_text())["status"] == SUCCESS
    assert (tmp_path / "records" / "42.csv").is_file()
    header, rows = read_perf_csv(tmp_path)
    assert header == list(PERF_CSV_COLUMNS)
    assert [(row["model"], row["performance"], row["metric"], row["status"]) for row in rows] == [
        ("primus_llama", "10123.4", "tok/s", SUCCESS)
    ]


def test_perf_csv_has_mads_29_columns():
    assert len(PERF_CSV_COLUMNS) == 29


def test_perf_row_describes_the_multi_node_run(tmp_path):
    write_clean_job(tmp_path, "42")
    row = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record["rows"][0]
    assert (row["nnodes"], row["gpus_per_node"], row["n_gpus"]) == ("3", "8", "24")
    assert (row["deployment_type"], row["launcher"]) == ("slurm", "slurm_multi")
    assert (row["tags"], row["args"], row["test_duration"]) == ("pyt,primus", "--steps 10", "100.00")


def test_the_row_says_which_image_ran_and_the_record_which_machine_and_image_each_node_ran(tmp_path):
    provenance = {
        "docker_image": "ci-primus_llama",
        "base_docker": "rocm/pytorch:6.4",
        "docker_sha": "sha256:" + "b" * 64,
        "build_duration": "41.5",
        "git_commit": "c" * 40,
    }
    for rank, node in enumerate(NODES):
        status = clean_status(
            node,
            rank,
            launcher="torchrun",
            provenance=provenance,
            gpu_architecture="gfx942",
            image_id=f"sha256:{rank}",
            hostname=f"host-{node}",
        )
        write_node(tmp_path, "42", node, status, log="performance: 3.0 tok/s\n" if rank == 2 else "")
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record
    row = record["rows"][0]
    assert {column: row[column] for column in provenance} == provenance
    assert (row["launcher"], row["gpu_architecture"]) == ("torchrun", "gfx942")
    assert [(entry["image_id"], entry["hostname"]) for entry in record["per_node"].values()] == [
        ("sha256:0", "host-node1"),
        ("sha256:1", "host-node2"),
        ("sha256:2", "host-node3"),
    ]
    # A card that names its own docker_image keeps it (MAD's card keys win, as before).
    card_image = collect_job(str(tmp_path), "42", model=dict(MODEL, docker_image="mine"), nodes=NODES, force=True)
    assert card_image.record["rows"][0]["docker_image"] == "mine"


def test_metric_comes_from_the_last_line_of_the_last_rank_that_reports(tmp_path):
    for rank, node in enumerate(NODES):
        log = f"performance: {rank}.0 tok/s\nperformance: {rank}.5 tok/s\n" if node != "node3" else "x\n"
        write_node(tmp_path, "42", node, clean_status(node, rank), log=log)
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record
    assert record["rows"][0]["performance"] == "1.5"
    assert record["metric_source"] == os.path.join("42", "attempt-0", "nodes", "node2", "run.log")


def test_multiple_results_give_one_row_per_csv_row_from_the_worker_that_has_them(tmp_path):
    results = {"multiple_results": "perf_ep.csv"}
    for rank, node in enumerate(NODES):
        files = {"perf_ep.csv": "model, performance, metric\n"}
        if node == "node2":
            files["perf_ep.csv"] += "dispatch_fp8, 120.5 ,GB/s\ncombine_bf16,98,GB/s\nsweep_1gb,,GB/s\n"
        write_node(tmp_path, "42", node, clean_status(node, rank), log="", files=files)
    record = collect_job(str(tmp_path), "42", model=dict(MODEL, **results), nodes=NODES).record
    assert [(row["model"], row["performance"], row["status"]) for row in record["rows"]] == [
        ("primus_llama_dispatch_fp8", "120.5", SUCCESS),
        ("primus_llama_combine_bf16", "98", SUCCESS),
        ("primus_llama_sweep_1gb", "", FAILURE),
    ]
    assert record["metric_source"] == os.path.join("42", "attempt-0", "nodes", "node2", "perf_ep.csv")


def test_each_local_ranks_results_csv_is_a_candidate_and_the_record_says_which_one_was_chosen(tmp_path):
    header = "model,performance,metric\n"
    files = {
        "perf_ep_rank0.csv": header + "a,1,GB/s\n",
        "perf_ep_rank1.csv": header + "a,1,GB/s\nb,2,GB/s\n",
        "perf_ep_rankx.csv": header + "a,1,GB/s\nb,2,GB/s\nc,3,GB/s\n",  # no rank number: not the model's
        "other.csv": header + "a,1,GB/s\nb,2,GB/s\nc,3,GB/s\n",
    }
    write_node(tmp_path, "42", "node1", clean_status("node1", 0), log="", files=files)
    record = collect_job(str(tmp_path), "42", model=dict(MODEL, multiple_results="perf_ep.csv"), nodes=["node1"]).record
    chosen = os.path.join("42", "attempt-0", "nodes", "node1", "perf_ep_rank1.csv")
    assert record["metric_source"] == chosen and len(record["rows"]) == 2
    report = {os.path.basename(entry["path"]): entry["selected"] for entry in record["results_csv_candidates"]}
    assert report == {"perf_ep_rank0.csv": False, "perf_ep_rank1.csv": True}


def test_extra_results_columns_reach_the_job_csv_but_not_perf_csv(tmp_path):
    write_node(
        tmp_path,
        "42",
        "node1",
        clean_status("node1", 0),
        log="",
        files={"r.csv": "model,performance,metric,batch\na,1,x,32\n"},
    )
    collect_job(str(tmp_path), "42", model={"name": "m", "multiple_results": "r.csv"}, nodes=["node1"])
    with open(tmp_path / "records" / "42.csv", newline="") as handle:
        assert next(csv.DictReader(handle))["batch"] == "32"
    assert "batch" not in read_perf_csv(tmp_path)[0]


def collect_results_csv(results_dir, text, log=""):
    """Collect a one-node job whose model wrote `text` as its results CSV (bytes are written as they are)."""
    node_dir = write_node(results_dir, "42", "node1", clean_status("node1", 0), log=log)
    (node_dir / "r.csv").write_bytes(text if isinstance(text, bytes) else text.encode())
    return collect_job(str(results_dir), "42", model={"name": "m", "multiple_results": "r.csv"}, nodes=["node1"])


@pytest.mark.parametrize("cell", ["nan", "NaN", "inf", "-inf", "N/A", "FAILED", "-", "1e999"])
def test_a_results_csv_cell_that_is_no_finite_number_is_a_failure_row_with_its_reason(tmp_path, cell):
    record = collect_results_csv(tmp_path, f"model,performance,metric\ngood,12.5,tok/s\nbad,{cell},tok/s\n").record
    rows = {row["model"]: row for row in record["rows"]}
    assert rows["m_good"]["status"] == SUCCESS and "failure_reason" not in rows["m_good"]
    assert rows["m_bad"]["status"] == FAILURE
    why = "not finite" if cell == "1e999" else "not a plain decimal number"
    assert rows["m_bad"]["failure_reason"] == f"performance {cell!r} is no figure: {why}"
    assert record["status"] == SUCCESS  # the job's verdict follows its rows: one figure is a result
    assert [row["status"] for row in read_perf_csv(tmp_path)[1]] == [SUCCESS, FAILURE]


def test_a_results_csv_of_no_finite_number_fails_the_job(tmp_path):
    record = collect_results_csv(tmp_path, "model,performance,metric\na,nan,x\nb,N/A,x\nc,FAILED,x\n").record
    assert record["status"] == FAILURE and NO_METRIC_REASON in record["reason"]
    assert {row["status"] for row in record["rows"]} == {FAILURE}


def test_a_results_csv_of_non_numbers_does_not_beat_the_logs_performance_line(tmp_path):
    record = collect_results_csv(
        tmp_path, "model,performance,metric\na,N/A,x\n", log="performance: 77.5 tok/s\n"
    ).record
    assert record["status"] == SUCCESS
    assert [(row["performance"], row["metric"]) for row in record["rows"]] == [("77.5", "tok/s")]


def test_a_trailing_comma_on_every_results_csv_row_moves_no_figure_a_column_over(tmp_path):
    record = collect_results_csv(tmp_path, "model,performance,metric\nllama,1234.5,tok/s,\nqwen,99,tok/s,\n").record
    assert [(row["model"], row["performance"], row["metric"]) for row in record["rows"]] == [
        ("m_llama", "1234.5", "tok/s"),
        ("m_qwen", "99", "tok/s"),
    ]
    assert record["status"] == SUCCESS


def test_a_results_csv_with_a_utf8_byte_order_mark_reads_its_first_column(tmp_path):
    record = collect_results_csv(tmp_path, "\ufeffmodel,performance,metric\nllama,10,tok/s\n".encode()).record
    assert record["results_csv_candidates"][0]["skipped"] is None
    assert [(row["model"], row["performance"], row["status"]) for row in record["rows"]] == [("m_llama", "10", SUCCESS)]


def test_failed_job_still_gets_a_failure_row(tmp_path):
    write_node(tmp_path, "42", "node1", clean_status("node1", 0, status=FAILURE, exit_code=1), log="boom\n")
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=["node1"]).record
    _, rows = read_perf_csv(tmp_path)
    assert record["status"] == FAILURE
    assert [(row["model"], row["performance"], row["status"]) for row in rows] == [("primus_llama", "", FAILURE)]


def test_job_that_never_ran_gets_a_failure_record_naming_every_node(tmp_path):
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record
    assert record["status"] == FAILURE
    assert all(node in record["reason"] for node in NODES)


def test_collecting_a_collected_job_again_changes_nothing(tmp_path):
    write_clean_job(tmp_path, "42")
    collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    before = {path: path.read_bytes() for path in (tmp_path / "records" / "42.json", tmp_path / "perf.csv")}
    write_node(tmp_path, "42", "node1", clean_status("node1", 0, exit_code=1))  # late evidence is not re-decided
    again = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    assert not again.changed
    assert again.record["status"] == SUCCESS
    assert {path: path.read_bytes() for path in before} == before


def test_force_decides_a_collected_job_again(tmp_path):
    write_clean_job(tmp_path, "42")
    collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    write_node(tmp_path, "42", "node1", clean_status("node1", 0, exit_code=1))
    again = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, force=True)
    assert again.changed and again.record["status"] == FAILURE
    assert read_perf_csv(tmp_path)[1][0]["status"] == FAILURE


def test_recollect_restores_a_perf_csv_that_lost_the_jobs_row(tmp_path):
    write_clean_job(tmp_path, "42")
    collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    (tmp_path / "perf.csv").unlink()
    assert collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).changed
    assert len(read_perf_csv(tmp_path)[1]) == 1


def test_check_mode_decides_without_writing(tmp_path):
    write_clean_job(tmp_path, "42")
    collection = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, write=False)
    assert collection.changed and collection.record["status"] == SUCCESS
    assert not (tmp_path / "records").exists() and not (tmp_path / "perf.csv").exists()


def test_nodes_default_to_the_node_directories_in_rank_order(tmp_path):
    write_node(tmp_path, "42", "b-node", clean_status("b-node", 0), log="")
    write_node(tmp_path, "42", "a-node", clean_status("a-node", 1), log="performance: 3 tok/s\n")
    record = collect_job(str(tmp_path), "42", model=MODEL).record
    assert record["nodes"] == ["b-node", "a-node"]
    assert record["status"] == SUCCESS


@pytest.mark.parametrize("job_id", ["../etc", "a/b", "", ".", ".hidden"])
def test_job_id_that_could_escape_the_results_dir_is_refused(tmp_path, job_id):
    with pytest.raises(JobLayoutError, match="not a SLURM job ID"):
        collect_job(str(tmp_path), job_id)


def test_malformed_existing_record_is_refused_and_left_in_place(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    (records / "42.json").write_text("{ truncated")
    with pytest.raises(JobLayoutError, match="cannot be read"):
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    assert (records / "42.json").read_text() == "{ truncated"


def test_malformed_record_is_left_out_of_perf_csv_reported_and_kept(tmp_path):
    write_clean_job(tmp_path, "41")
    collect_job(str(tmp_path), "41", model=MODEL, nodes=NODES)
    (tmp_path / "records" / "40.json").write_text("[1, 2]")
    update = regenerate_perf_csv(str(tmp_path))
    assert [entry["path"] for entry in update.skipped] == [str(tmp_path / "records" / "40.json")]
    assert update.rows == 1 and len(read_perf_csv(tmp_path)[1]) == 1
    assert (tmp_path / "records" / "40.json").read_text() == "[1, 2]"


def test_perf_csv_lists_jobs_in_job_id_order(tmp_path):
    for job_id in ("100", "99", "7"):
        write_clean_job(tmp_path, job_id, metric=f"performance: {job_id} tok/s\n")
        collect_job(str(tmp_path), job_id, model=MODEL, nodes=NODES)
    assert [row["performance"] for row in read_perf_csv(tmp_path)[1]] == ["7", "99", "100"]


def test_failure_record_from_outside_names_the_slurm_state_and_keeps_node_evidence(tmp_path):
    write_node(tmp_path, "42", "node1", clean_status("node1", 0, status=FAILURE, cancelled=True))
    collection = write_failure_record(
        str(tmp_path), "42", "job ended without a record", slurm_state="TIMEOUT", model=MODEL, nodes=["node1"]
    )
    assert collection.changed
    assert collection.record["status"] == FAILURE and collection.record["slurm_state"] == "TIMEOUT"
    assert collection.record["reason"].startswith(
        "job ended without a record (SLURM state TIMEOUT); node1 (rank 0): cancelled"
    )
    assert read_perf_csv(tmp_path)[1][0]["status"] == FAILURE


def test_failure_record_from_outside_never_overwrites_a_record(tmp_path):
    write_clean_job(tmp_path, "42")
    collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    collection = write_failure_record(str(tmp_path), "42", "afterany", slurm_state="COMPLETED")
    assert not collection.changed and collection.record["status"] == SUCCESS
    assert load_record(str(tmp_path), "42")["status"] == SUCCESS


def _collect_jobs_in_step(results_dir, job_ids, barrier):
    for job_id in job_ids:
        barrier.wait(30)  # both processes start each collect together: the worst case for lost updates
        collect_job(results_dir, job_id, model=MODEL, nodes=NODES)


def test_two_processes_collecting_different_jobs_at_once_lose_no_rows(tmp_path):
    batches = [[f"{first}{i:02d}" for i in range(8)] for first in (1, 2)]
    for job_id in batches[0] + batches[1]:
        write_clean_job(tmp_path, job_id, metric=f"performance: {job_id} tok/s\n")
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    workers = [context.Process(target=_collect_jobs_in_step, args=(str(tmp_path), batch, barrier)) for batch in batches]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert sorted(os.listdir(tmp_path / "records")) == sorted(
        name for job_id in batches[0] + batches[1] for name in (job_id, job_id + ".csv", job_id + ".json")
    )
    assert sorted(row["performance"] for row in read_perf_csv(tmp_path)[1]) == sorted(batches[0] + batches[1])


def test_collect_waits_while_another_process_holds_the_results_lock(tmp_path):
    write_clean_job(tmp_path, "42")
    context = multiprocessing.get_context("fork")
    lock_fd = os.open(str(tmp_path / "perf.csv.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    collector = context.Process(target=collect_job, args=(str(tmp_path), "42"), kwargs={"nodes": NODES})
    try:
        collector.start()
        collector.join(1.0)
        assert collector.is_alive() and not (tmp_path / "records" / "42.json").exists()
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)
    collector.join(30)
    assert collector.exitcode == 0 and (tmp_path / "records" / "42.json").exists()


def test_a_lock_held_past_the_timeout_is_an_error_naming_the_file_and_what_to_do(tmp_path):
    # Held by another process (flock locks belong to the open file): this one waits, then gives up with a reason.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "perf.csv.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JobLayoutError, match=r"another process has held .*perf\.csv\.lock for 0 s; if no collect"):
            with _ResultsLock(str(tmp_path), timeout=0.3):
                pass
    finally:
        holder.kill()
        holder.wait()


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_results_csv_column_named_like_a_perf_csv_column_wins_over_the_model_card(tmp_path):
    write_node(
        tmp_path,
        "42",
        "node1",
        clean_status("node1", 0),
        log="",
        files={"r.csv": "model,performance,metric,training_precision\na,1,x,fp8\n"},
    )
    model = {"name": "m", "multiple_results": "r.csv", "training_precision": "bf16"}
    row = collect_job(str(tmp_path), "42", model=model, nodes=["node1"]).record["rows"][0]
    assert row["training_precision"] == "fp8"


# ---------------------------------------------------------------------------------------------------------------
# A requeued job (SLURM keeps its ID): one record per attempt, the job's record names them all


def test_a_requeued_attempt_gets_its_own_record_though_the_job_has_one(tmp_path):
    write_clean_job(tmp_path, "42", metric="performance: 1111 tok/s\n", attempt=0)
    collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=0)
    write_clean_job(tmp_path, "42", metric="performance: 2222 tok/s\n", attempt=1)
    second = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=1)
    assert second.changed and second.attempt == 1
    assert second.record_path == str(tmp_path / "records" / "42" / "attempt-1.json")
    assert load_record(str(tmp_path), "42", 0)["rows"][0]["performance"] == "1111"
    assert load_record(str(tmp_path), "42", 1)["rows"][0]["performance"] == "2222"


def test_the_jobs_record_is_its_last_attempts_and_names_every_attempt(tmp_path):
    write_clean_job(tmp_path, "42", metric="performance: 1111 tok/s\n", attempt=0)
    collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=0)
    write_node(tmp_path, "42", "node1", clean_status("node1", 0, exit_code=1), log="boom\n", attempt=1)
    collect_job(str(tmp_path), "42", model=MODEL, nodes=["node1"], attempt=1)
    record = load_record(str(tmp_path), "42")
    assert (record["attempt"], record["status"]) == (1, FAILURE)
    assert [(entry["attempt"], entry["status"], entry["record"]) for entry in record["attempts"]] == [
        (0, SUCCESS, os.path.join("records", "42", "attempt-0.json")),
        (1, FAILURE, os.path.join("records", "42", "attempt-1.json")),
    ]
    with open(tmp_path / "records" / "42.csv", newline="") as handle:
        assert [row["status"] for row in csv.DictReader(handle)] == [FAILURE]


def test_perf_csv_carries_the_last_attempt_only(tmp_path):
    for attempt, figure in ((0, "1111"), (1, "2222")):
        write_clean_job(tmp_path, "42", metric=f"performance: {figure} tok/s\n", attempt=attempt)
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=attempt)
    assert [row["performance"] for row in read_perf_csv(tmp_path)[1]] == ["2222"]


def test_an_earlier_attempts_node_files_never_stand_for_a_later_attempt(tmp_path):
    write_clean_job(tmp_path, "42", attempt=0)  # attempt 0 succeeded, and was never collected
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=1).record
    assert record["status"] == FAILURE and "no status.json" in record["reason"]


def test_an_earlier_attempts_abort_marker_never_fails_a_later_attempt(tmp_path):
    write_clean_job(tmp_path, "42", attempt=0)
    (tmp_path / "42" / "attempt-0" / "ABORT").write_text('{"rank": 1, "node": "node2", "reason": "boom"}')
    write_clean_job(tmp_path, "42", attempt=1)
    assert collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=1).record["status"] == SUCCESS


def test_collecting_a_recorded_attempt_again_changes_nothing(tmp_path):
    for attempt in (0, 1):
        write_clean_job(tmp_path, "42", attempt=attempt)
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=attempt)
    files = [
        tmp_path / "records" / "42.json",
        tmp_path / "records" / "42.csv",
        tmp_path / "perf.csv",
        tmp_path / "records" / "42" / "attempt-1.json",
    ]
    before = [(path.read_bytes(), path.stat().st_mtime_ns) for path in files]
    for attempt in (1, 0, None):
        assert not collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=attempt).changed
    assert [(path.read_bytes(), path.stat().st_mtime_ns) for path in files] == before


def test_the_attempt_defaults_to_the_jobs_last_attempt_on_disk(tmp_path):
    write_clean_job(tmp_path, "42", attempt=0)
    write_clean_job(tmp_path, "42", attempt=2)
    assert collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).attempt == 2


def test_an_afterany_failure_record_is_written_for_an_attempt_that_left_none(tmp_path):
    write_clean_job(tmp_path, "42", attempt=0)
    collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES, attempt=0)
    collection = write_failure_record(
        str(tmp_path), "42", "ended without a record", slurm_state="NODE_FAIL", model=MODEL, nodes=NODES, attempt=1
    )
    assert collection.changed and collection.attempt == 1
    assert load_record(str(tmp_path), "42")["slurm_state"] == "NODE_FAIL"


@pytest.mark.parametrize("attempt", [-1, "one", True])
def test_an_attempt_that_is_not_a_restart_count_is_refused(tmp_path, attempt):
    with pytest.raises(JobLayoutError, match="not an attempt number"):
        collect_job(str(tmp_path), "42", attempt=attempt)


# ---------------------------------------------------------------------------------------------------------------
# A results dir shared with other users: the lock, ownership, planted symlinks


def test_the_lock_file_is_created_0664_whatever_the_umask(tmp_path):
    write_clean_job(tmp_path, "42")
    old = os.umask(0o077)
    try:
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "perf.csv.lock").stat().st_mode) == 0o664


def _flock_failing_with(monkeypatch, error_number):
    real_flock = fcntl.flock

    def flock(fd, operation):
        if operation & fcntl.LOCK_EX:
            raise OSError(error_number, os.strerror(error_number))
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_nfs_without_lock_support_gets_its_own_clear_error(tmp_path, monkeypatch):
    # No real NFSv3 'nolock' mount here: flock raises what the kernel's NFS client raises there (ENOLCK).
    write_clean_job(tmp_path, "42")
    _flock_failing_with(monkeypatch, errno.ENOLCK)
    with pytest.raises(JobLayoutError) as failure:
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    message = str(failure.value)
    assert str(tmp_path / "perf.csv.lock") in message and "nolock" in message and "remount" in message
    assert not (tmp_path / "records" / "42.json").exists()


def test_a_lock_this_filesystem_refuses_read_only_names_the_fix(tmp_path, monkeypatch):
    # NFS emulates flock with POSIX locks, which refuse a read-only descriptor (EBADF).
    write_clean_job(tmp_path, "42")
    _flock_failing_with(monkeypatch, errno.EBADF)
    with pytest.raises(JobLayoutError, match=r"not writable by you.*chmod 0664"):
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)


def test_a_symlink_planted_at_the_lock_file_is_refused_and_its_target_untouched(tmp_path):
    write_clean_job(tmp_path, "42")
    target = tmp_path / "elsewhere"
    (tmp_path / "perf.csv.lock").symlink_to(target)
    with pytest.raises(JobLayoutError, match="symbolic link"):
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    assert not target.exists()


@pytest.mark.parametrize(
    "planted", [os.path.join("records", "42.json"), os.path.join("records", "42", "attempt-0.json")]
)
def test_a_symlink_planted_at_a_record_is_refused_and_its_target_untouched(tmp_path, planted):
    write_clean_job(tmp_path, "42")
    target = tmp_path / "victim.json"
    target.write_text('{"rows": []}\n')
    (tmp_path / "records" / "42").mkdir(parents=True)
    (tmp_path / planted).symlink_to(target)
    with pytest.raises(JobLayoutError, match="is a symbolic link"):
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)
    assert target.read_text() == '{"rows": []}\n'


def test_a_symlink_planted_at_perf_csv_is_replaced_not_followed(tmp_path):
    write_clean_job(tmp_path, "42")
    target = tmp_path / "victim.csv"
    target.write_text("precious\n")
    (tmp_path / "perf.csv").symlink_to(target)
    assert collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record["status"] == SUCCESS
    assert target.read_text() == "precious\n"
    assert not (tmp_path / "perf.csv").is_symlink() and len(read_perf_csv(tmp_path)[1]) == 1


def test_a_symlink_planted_at_a_temp_file_name_is_never_written_through(tmp_path, monkeypatch):
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils import safe_files

    target = tmp_path / "victim"
    target.write_text("precious\n")
    (tmp_path / ".perf.csv.0000000000000000.tmp").symlink_to(target)
    monkeypatch.setattr(safe_files.secrets, "token_hex", lambda size: "0" * (2 * size))
    with pytest.raises(OSError):
        safe_files.write_file_atomically(str(tmp_path / "perf.csv"), b"rows\n")
    assert target.read_text() == "precious\n"


def test_a_results_dir_owned_by_another_user_is_refused(tmp_path):
    write_clean_job(tmp_path / "results", "42")
    os.chown(tmp_path / "results", 65534, 65534)
    with pytest.raises(JobLayoutError, match=r"owned by .*uid 65534.*not by you"):
        collect_job(str(tmp_path / "results"), "42", model=MODEL, nodes=NODES)
    assert not (tmp_path / "results" / "records").exists()


def test_a_job_dir_owned_by_another_user_is_refused(tmp_path):
    write_clean_job(tmp_path, "42")
    os.chown(tmp_path / "42", 65534, 65534)
    with pytest.raises(JobLayoutError, match=r"job directory .*42 is owned by"):
        collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES)


@pytest.mark.parametrize("where", ["results", "job"])
def test_a_dir_every_user_may_write_without_the_sticky_bit_is_refused(tmp_path, where):
    write_clean_job(tmp_path / "results", "42")
    path = tmp_path / "results" / ("42" if where == "job" else "")
    path.chmod(0o777)
    with pytest.raises(JobLayoutError, match=r"writable by every user without the sticky bit.*chmod go-w"):
        collect_job(str(tmp_path / "results"), "42", model=MODEL, nodes=NODES)


def test_a_world_writable_results_dir_with_the_sticky_bit_is_accepted(tmp_path):
    write_clean_job(tmp_path / "results", "42")
    (tmp_path / "results").chmod(0o1777)
    assert collect_job(str(tmp_path / "results"), "42", model=MODEL, nodes=NODES).record["status"] == SUCCESS


def test_a_symlink_planted_as_the_job_dir_is_refused(tmp_path):
    write_clean_job(tmp_path / "elsewhere", "42")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "42").symlink_to(tmp_path / "elsewhere" / "42")
    with pytest.raises(JobLayoutError, match="symbolic link"):
        collect_job(str(tmp_path / "results"), "42", model=MODEL, nodes=NODES)


# ---------------------------------------------------------------------------------------------------------------
# The record's stage timeline and cross-node summary (module_utils/results/timeline.py)


def _span(start, end):
    return {"start": 1000.0 + start, "end": 1000.0 + end}


def test_the_record_carries_each_nodes_steps_barrier_wait_and_the_load_straggler(tmp_path):
    results = tmp_path / "results"
    steps = {
        "node1": {"build": _span(0, 5), "barrier": _span(5, 48), "run": _span(50, 60)},
        "node2": {"load": _span(5, 8), "barrier": _span(8, 48), "run": _span(50, 60)},
        "node3": {"load": _span(5, 46), "barrier": _span(46, 48), "run": _span(50, 60)},
    }
    for rank, node in enumerate(NODES):
        log = "performance: 10.0 tok/s\n" if node == "node3" else ""
        write_node(results, "42", node, clean_status(node, rank, steps=steps[node]), log=log)
    write_node(results, "42", "node4", None)  # a node that left no status has no steps

    record = collect_job(str(results), "42", MODEL, NODES + ["node4"]).record

    assert record["timeline"] == dict(steps, node4={})
    assert record["barrier_wait"] == {"node1": 43.0, "node2": 40.0, "node3": 2.0}
    load = next(entry for entry in record["stragglers"] if entry["step"] == "load")
    assert (load["node"], load["straggler"]) == ("node3", True)
    assert load_record(str(results), "42")["timeline"] == record["timeline"]  # the job's record has it too


def test_the_record_summarises_a_figure_several_ranks_report_and_flags_the_outlier(tmp_path):
    results = tmp_path / "results"
    figures = {"node1": "100.0", "node2": "101.0", "node3": "70.0", "node4": "99.5"}
    nodes = list(figures)
    for rank, node in enumerate(nodes):
        # Each node's last figure counts: node1's warm-up line is not its figure.
        log = ("performance: 5.0 samples/s\n" if node == "node1" else "") + f"performance: {figures[node]} samples/s\n"
        write_node(results, "42", node, clean_status(node, rank), log=log)

    summary = collect_job(str(results), "42", MODEL, nodes).record["perf_summary"]["samples/s"]

    assert summary["per_node"] == {"node1": 100.0, "node2": 101.0, "node3": 70.0, "node4": 99.5}
    assert summary["n_nodes"] == 4 and summary["mean"] == pytest.approx(92.625)
    assert summary["std"] == pytest.approx(15.096, abs=1e-3) and summary["cv"] == pytest.approx(0.16298, abs=1e-4)
    assert summary["outliers"] == ["node3"]


def test_two_ranks_reporting_figures_near_the_float_limit_still_get_a_record(tmp_path):
    write_clean_job(tmp_path, "42", metric_on="node3")
    write_node(tmp_path, "42", "node2", clean_status("node2", 1), log="performance: 1e308 tok/s\n")
    write_node(tmp_path, "42", "node3", clean_status("node3", 2), log="performance: 1e308 tok/s\n")
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record
    assert record["status"] == SUCCESS and record["perf_summary"]["tok/s"]["mean"] == 1e308
    assert json.loads((tmp_path / "records" / "42.json").read_text())["rows"][0]["performance"] == "1e308"


# ---------------------------------------------------------------------------------------------------------------
# A hung run (the watchdog: module_utils/run/hang/watch.py) and MAD's tools on every node


def test_a_hung_run_is_a_failure_whose_reason_names_the_stuck_rank(tmp_path):
    write_hung_job(tmp_path)
    record = collect_job(str(tmp_path), "42", MODEL, NODES).record
    assert record["status"] == FAILURE
    assert record["reason"] == (
        "hang: rank 2 (node3) is stuck in load_batch (ddp_hang.py:22) while ranks 0 and 1 wait in all_reduce"
    )


def test_a_hung_runs_record_holds_the_finding_with_each_nodes_stacks_file(tmp_path):
    write_hung_job(tmp_path)
    hang = collect_job(str(tmp_path), "42", MODEL, NODES).record["hang"]
    assert (hang["kind"], hang["stuck_ranks"], hang["waiting_ranks"]) == ("collective", [2], [0, 1])
    assert hang["stacks"] == {node: f"nodes/{node}/stacks.txt" for node in NODES}


def test_each_hung_node_says_so_rather_than_its_stopped_containers_exit_code(tmp_path):
    write_hung_job(tmp_path)
    per_node = collect_job(str(tmp_path), "42", MODEL, NODES).record["per_node"]
    assert [(entry["hang"], entry["reason"]) for entry in per_node.values()] == [(True, HUNG_NODE_REASON)] * 3


def test_a_run_that_hung_in_rendezvous_names_the_rank_that_never_joined(tmp_path):
    write_hung_job(tmp_path, stacks_case="init")
    record = collect_job(str(tmp_path), "42", MODEL, NODES).record
    assert record["hang"]["never_joined"] == [2]
    assert record["reason"] == (
        "hang: ranks 0 and 1 wait in init_process_group; rank 2 (node3) never joined: it is in load_weights "
        "(ddp_hang.py:26)"
    )


def test_a_hung_node_that_left_no_stacks_is_named_as_the_one_the_others_wait_for(tmp_path):
    write_hung_job(tmp_path, without_stacks=("node3",))
    record = collect_job(str(tmp_path), "42", MODEL, NODES).record
    assert record["hang"]["stuck_ranks"] == [2]
    assert record["reason"].startswith("hang: rank 2 (node3) left no stacks (node3 wrote no stacks.json) while")


def test_a_node_that_failed_by_itself_during_a_hang_is_named_after_the_finding(tmp_path):
    write_hung_job(tmp_path)
    lost = tmp_path / "42" / "attempt-0" / "nodes" / "node2" / "status.json"
    lost.unlink()
    record = collect_job(str(tmp_path), "42", MODEL, NODES).record
    assert record["reason"].startswith("hang: ")
    assert record["reason"].endswith("; node2 (rank 1): no status.json: its run stage never ran or the node was lost")


def test_a_run_that_did_not_hang_has_no_finding(tmp_path):
    write_clean_job(tmp_path, "42")
    assert collect_job(str(tmp_path), "42", MODEL, NODES).record["hang"] is None


def test_the_record_lists_each_nodes_tools_and_their_outputs(tmp_path):
    for rank, node in enumerate(NODES):
        outputs = [f"tools/pyspy-rank{rank}.svg", "tools/test_tools_A.log"]
        status = clean_status(node, rank, tools=["test_tools_A", "pyspy_record"], tool_outputs=outputs)
        write_node(tmp_path, "42", node, status, log="performance: 10 tok/s\n")
    per_node = collect_job(str(tmp_path), "42", MODEL, NODES).record["per_node"]
    assert per_node["node3"]["tools"] == ["test_tools_A", "pyspy_record"]
    assert {node: entry["tool_outputs"][0] for node, entry in per_node.items()} == {
        node: f"tools/pyspy-rank{rank}.svg" for rank, node in enumerate(NODES)
    }
