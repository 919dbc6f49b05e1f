"""A results CSV's header as pandas reads it, and the one rule that says what a performance figure is.

The cases of the second trust pass (BOM, trailing comma on rows, N/A and nan cells, duplicates, missing columns)
live in test_results_collection.py; these are issue 42's (item 8), each seen to fail before its fix.
"""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, SUCCESS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import collect_job
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_csv import (
    read_results_csv,
    select_best_results_csv,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.verdict import NO_METRIC_REASON
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import (
    parse_performance_line,
    performance_figure,
)
from tests.unit.module_utils.results.test_results_collection import clean_status, collect_results_csv, write_node


@pytest.mark.parametrize("commas", [",,", ",,,", ", , ,"])
def test_a_header_ending_in_empty_columns_is_read_and_its_empty_columns_ignored(tmp_path, commas):
    path = tmp_path / "r.csv"
    path.write_text(f"model,performance,metric{commas}\nllama,10.5,tok/s{commas}\nqwen,3,tok/s\n")
    best, report = select_best_results_csv([str(path)])
    assert report[0]["skipped"] is None and best == str(path)
    assert read_results_csv(str(path)).to_dict(orient="records") == [
        {"model": "llama", "performance": "10.5", "metric": "tok/s"},
        {"model": "qwen", "performance": "3", "metric": "tok/s"},
    ]


def test_an_empty_column_keeps_the_named_ones_after_it_in_their_place(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("model,,performance,metric,batch,\nllama,ignored,10,tok/s,32,\n")
    assert read_results_csv(str(path)).to_dict(orient="records") == [
        {"model": "llama", "performance": "10", "metric": "tok/s", "batch": "32"}
    ]


def test_a_quoted_header_with_spaces_after_its_commas_names_the_columns(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text('"model", "performance", "metric"\n"llama", "10", "tok/s"\n')
    best, report = select_best_results_csv([str(path)])
    assert report[0]["skipped"] is None and best == str(path) and report[0]["non_empty_rows"] == 1
    assert read_results_csv(str(path)).to_dict(orient="records") == [
        {"model": "llama", "performance": "10", "metric": "tok/s"}
    ]


def test_a_header_whose_only_repeat_is_an_empty_name_is_no_duplicate_but_a_named_repeat_still_is(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("model,performance,metric,,performance\na,1,x,,2\n")
    _, report = select_best_results_csv([str(path)])
    assert report[0]["skipped"] == "duplicate column(s) performance"


# --------------------------------------------------------------------------------------------------------------
# The figure rule: a plain positive finite decimal, scientific notation allowed


@pytest.mark.parametrize(
    "cell, figure",
    [("10", 10.0), ("1.5e3", 1500.0), ("1.5E+3", 1500.0), ("2e-3", 0.002), ("10.", 10.0), (".5", 0.5)]
    + [(" 12.5 ", 12.5), ("0.001", 0.001), ("1e308", 1e308)],
)
def test_a_plain_positive_finite_decimal_is_a_figure(cell, figure):
    assert performance_figure(cell) == pytest.approx(figure)


@pytest.mark.parametrize(
    "cell, why",
    [
        ("-1", "negative"),
        ("-0.5", "negative"),
        ("0", "zero"),
        ("0.0", "zero"),
        ("0e10", "zero"),
        ("1e-400", "zero"),  # underflows: no throughput a benchmark reports
        ("1_000", "not a plain decimal number"),
        ("\u0663", "not a plain decimal number"),  # ARABIC-INDIC DIGIT THREE: float() reads it as 3
        ("\uff11\uff12", "not a plain decimal number"),  # fullwidth 12
        ("+7", "not a plain decimal number"),
        ("1 000", "not a plain decimal number"),
        ("0x10", "not a plain decimal number"),
        ("1e999", "not finite"),
        ("nan", "not a plain decimal number"),
        ("inf", "not a plain decimal number"),
    ],
)
def test_anything_else_is_no_figure_and_the_row_says_which_cell_and_why(tmp_path, cell, why):
    assert performance_figure(cell) is None
    record = collect_results_csv(tmp_path, f"model,performance,metric\ngood,12.5,tok/s\nbad,{cell},tok/s\n").record
    rows = {row["model"]: row for row in record["rows"]}
    assert rows["m_good"]["status"] == SUCCESS
    assert rows["m_bad"]["status"] == FAILURE
    assert rows["m_bad"]["failure_reason"] == f"performance {cell.strip()!r} is no figure: {why}"
    assert record["results_csv_candidates"][0]["non_empty_rows"] == 1


def test_a_script_that_prints_minus_one_on_failure_fails_the_job(tmp_path):
    record = collect_results_csv(tmp_path, "model,performance,metric\nllama,-1,tok/s\n").record
    assert record["status"] == FAILURE and NO_METRIC_REASON in record["reason"]
    assert record["rows"][0]["failure_reason"] == "performance '-1' is no figure: negative"


@pytest.mark.parametrize("number, why", [("-1", "negative"), ("0", "zero"), ("+7", "not a plain decimal number")])
def test_a_log_line_whose_number_is_no_figure_fails_the_job_and_its_row_says_why(tmp_path, number, why):
    write_node(tmp_path, "42", "node1", clean_status("node1", 0), log=f"performance: {number} samples_per_second\n")
    record = collect_job(str(tmp_path), "42", model={"name": "m"}, nodes=["node1"]).record
    assert record["status"] == FAILURE
    (row,) = record["rows"]
    assert (row["performance"], row["metric"]) == (number, "samples_per_second")
    assert row["failure_reason"] == f"performance {number!r} is no figure: {why}"


def test_a_log_line_whose_digits_are_not_ascii_is_not_a_performance_line():
    # An Arabic-Indic digit is no ASCII digit: the line holds no number at all.
    assert parse_performance_line("performance: \u0663 samples_per_second") is None


def test_the_last_log_line_decides_even_when_an_earlier_one_held_a_figure(tmp_path):
    # A script that prints a warm-up figure, then -1 when it fails, did not succeed.
    log = "performance: 120 samples_per_second\nperformance: -1 samples_per_second\n"
    write_node(tmp_path, "42", "node1", clean_status("node1", 0), log=log)
    record = collect_job(str(tmp_path), "42", model={"name": "m"}, nodes=["node1"]).record
    assert record["status"] == FAILURE and record["rows"][0]["performance"] == "-1"
