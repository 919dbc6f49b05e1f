"""`slurm-multi report`: the perf table, and the comparison with a reference that passes or fails each model."""

import pytest

from slurm_multi.cli import main
from slurm_multi.reports import text as report

HEADER = "model,nnodes,n_gpus,performance,metric,status\n"


def _csv(path, *rows):
    path.write_text(HEADER + "".join(row + "\n" for row in rows))
    return path


def _frame(tmp_path, *rows, name="perf.csv"):
    return report.read_perf_csv(_csv(tmp_path / name, *rows))


def _compare(tmp_path, current_rows, reference_rows, tolerance=0.05):
    current = _frame(tmp_path, *current_rows, name="current.csv")
    reference = _frame(tmp_path, *reference_rows, name="reference.csv")
    return report.compare_with_reference(current, reference, tolerance).set_index("model")


def test_the_perf_table_shows_model_nodes_figure_metric_and_status(tmp_path):
    table = report.perf_table(_frame(tmp_path, "dummy,3,24,42.5,samples_per_second,SUCCESS"))
    assert table.splitlines()[1].split() == ["dummy", "3", "24", "42.5", "samples_per_second", "SUCCESS"]


def test_a_throughput_within_tolerance_passes(tmp_path):
    result = _compare(tmp_path, ["m,2,16,97,tokens/sec,SUCCESS"], ["m,2,16,100,tokens/sec,SUCCESS"])
    assert result.loc["m", "result"] == "PASS"
    assert result.loc["m", "change"] == "-3.00%"


def test_a_throughput_drop_beyond_tolerance_fails(tmp_path):
    result = _compare(tmp_path, ["m,2,16,90,tokens/sec,SUCCESS"], ["m,2,16,100,tokens/sec,SUCCESS"])
    assert result.loc["m", "result"] == "FAIL"
    assert "worse by 10.00%" in result.loc["m", "note"]


def test_a_throughput_gain_passes(tmp_path):
    assert (
        _compare(tmp_path, ["m,2,16,150,tokens/sec,SUCCESS"], ["m,2,16,100,tokens/sec,SUCCESS"]).loc["m", "result"]
        == "PASS"
    )


def test_a_latency_rise_beyond_tolerance_fails(tmp_path):
    result = _compare(tmp_path, ["m,2,16,120,latency_ms,SUCCESS"], ["m,2,16,100,latency_ms,SUCCESS"])
    assert result.loc["m", "result"] == "FAIL"


def test_a_latency_drop_passes(tmp_path):
    assert _compare(tmp_path, ["m,2,16,50,ms,SUCCESS"], ["m,2,16,100,ms,SUCCESS"]).loc["m", "result"] == "PASS"


def test_the_latest_row_of_a_model_is_compared(tmp_path):
    result = _compare(
        tmp_path, ["m,2,16,10,tokens/sec,SUCCESS", "m,2,16,100,tokens/sec,SUCCESS"], ["m,2,16,100,tokens/sec,SUCCESS"]
    )
    assert result.loc["m", "result"] == "PASS"


@pytest.mark.parametrize("figure", ["-1", "0", "1_000", "\u0663"])
def test_a_current_value_that_is_no_figure_by_the_verdicts_rule_fails(tmp_path, figure):
    # The one rule (perf_lines.figure_problem): a script printing -1 on failure has no figure, here as in a run's
    # verdict; "1,234.5" stays a figure, as in a log line.
    result = _compare(tmp_path, [f"m,2,16,{figure},tokens/sec,SUCCESS"], ["m,2,16,100,tokens/sec,SUCCESS"])
    assert result.loc["m", "result"] == "FAIL"
    assert result.loc["m", "note"] == "the latest run has no performance figure"
    assert report.parse_figure("1,234.5") == 1234.5


def test_a_failed_latest_run_fails(tmp_path):
    result = _compare(tmp_path, ["m,2,16,,,FAILURE"], ["m,2,16,100,tokens/sec,SUCCESS"])
    assert (result.loc["m", "result"], result.loc["m", "note"]) == ("FAIL", "the latest run is FAILURE")


def test_a_model_missing_from_the_results_fails(tmp_path):
    result = _compare(tmp_path, ["other,2,16,1,tokens/sec,SUCCESS"], ["m,2,16,100,tokens/sec,SUCCESS"])
    assert result.loc["m", "result"] == "FAIL"
    assert result.loc["other", "result"] == "NEW"


def test_a_changed_metric_fails(tmp_path):
    result = _compare(tmp_path, ["m,2,16,100,samples_per_second,SUCCESS"], ["m,2,16,100,tokens/sec,SUCCESS"])
    assert result.loc["m", "result"] == "FAIL"
    assert "metric changed" in result.loc["m", "note"]


@pytest.mark.parametrize("text, value", [("0.05", 0.05), ("5%", 0.05), ("0", 0.0), ("12.5%", 0.125)])
def test_a_tolerance_is_a_fraction_or_a_percentage(text, value):
    assert report.parse_tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["-1", "five", "nan"])
def test_a_tolerance_that_is_no_positive_number_is_refused(text):
    with pytest.raises(report.ReportError, match="tolerance"):
        report.parse_tolerance(text)


@pytest.mark.parametrize(
    "metric, lower",
    [
        ("tokens/sec", False),
        ("samples_per_second", False),
        ("tok/s", False),
        ("TFLOPS", False),
        ("ms", True),
        ("latency_ms", True),
        ("step_time_s", True),
        ("seconds", True),
        ("ttft", True),
    ],
)
def test_times_are_better_lower_and_rates_better_higher(metric, lower):
    assert report.lower_is_better(metric) is lower


def test_a_perf_file_without_the_needed_columns_is_refused_by_name(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("name,value\nm,1\n")
    with pytest.raises(report.ReportError, match="lacks the column.*model.*performance.*metric"):
        report.read_perf_csv(path)


# --- the command ----------------------------------------------------------------------------------------------------


def _report(tmp_path, capsys, *args):
    code = main(["report", "--results-dir", str(tmp_path), *args])
    return code, capsys.readouterr()


def test_report_prints_the_perf_table(tmp_path, capsys):
    _csv(tmp_path / "perf.csv", "dummy,3,24,42.5,samples_per_second,SUCCESS")
    code, out = _report(tmp_path, capsys)
    assert code == 0
    assert "42.5" in out.out


def test_report_compare_exits_zero_when_every_model_passes(tmp_path, capsys):
    _csv(tmp_path / "perf.csv", "m,2,16,99,tokens/sec,SUCCESS")
    reference = _csv(tmp_path / "ref.csv", "m,2,16,100,tokens/sec,SUCCESS")
    code, out = _report(tmp_path, capsys, "--compare", str(reference))
    assert code == 0
    assert "PASS" in out.out


def test_report_compare_exits_one_when_a_model_fails(tmp_path, capsys):
    _csv(tmp_path / "perf.csv", "m,2,16,80,tokens/sec,SUCCESS")
    reference = _csv(tmp_path / "ref.csv", "m,2,16,100,tokens/sec,SUCCESS")
    code, out = _report(tmp_path, capsys, "--compare", str(reference), "--tolerance", "10%")
    assert code == 1
    assert "FAIL" in out.out and "-20.00%" in out.out


def test_report_without_a_perf_csv_says_so(tmp_path, capsys):
    code, out = _report(tmp_path, capsys)
    assert code == 2
    assert "perf.csv does not exist" in out.err


# --- history and baselines ------------------------------------------------------------------------------------------


def _history_dir(tmp_path, *figures, model="m", metric="tokens/sec"):
    """Jobs 101, 102... of one model, recorded in that order; a figure None is a failed run."""
    from tests.support.lab.report_records import job_record, write_records

    return write_records(
        tmp_path / "results",
        *(
            job_record(
                str(101 + index),
                model,
                "" if figure is None else figure,
                status="SUCCESS" if figure is not None else "FAILURE",
                metric=metric,
                recorded_at=1.8e9 + 60 * index,
            )
            for index, figure in enumerate(figures)
        ),
    )


def test_the_history_holds_each_jobs_last_row_per_model_in_the_order_they_were_recorded():
    from tests.support.lab.report_records import job_record

    late = job_record("9", "m", 1, recorded_at=2e9)
    early = job_record("10", "m", 2, recorded_at=1e9)
    early["rows"].insert(0, dict(early["rows"][0], performance="7"))
    failed = job_record("11", "m", "", status="FAILURE", recorded_at=1.5e9)
    sweep = dict(job_record("12", "m", 5, recorded_at=1.6e9), sweep=[{"index": 0}])
    history = report.history_frame([late, early, failed, sweep])
    assert list(history["job_id"]) == ["10", "11", "9"]
    assert list(history["performance"]) == ["2", "", "1"]
    assert history["value"].isna().tolist() == [False, True, False]


def test_last_n_is_the_median_of_the_n_successful_runs_before_the_one_judged():
    from tests.support.lab.report_records import job_record

    figures = [("1", 50), ("2", 100), ("3", None), ("4", 110), ("5", 90), ("6", 80), ("7", 300)]
    history = report.history_frame(
        job_record(
            job,
            "m",
            "" if value is None else value,
            status="FAILURE" if value is None else "SUCCESS",
            recorded_at=1e9 + int(job),
        )
        for job, value in figures
    )
    current = report.current_runs(history, jobs=["6"])
    reference = report.history_reference(history, current, 3)
    # Jobs 2, 4, 5 (3 failed; 7 came after): median 100.
    assert reference.loc[0, "performance"] == "100"
    assert reference.loc[0, "baseline"] == "median of 3 run(s): job(s) 2, 4, 5"


def test_fewer_runs_than_asked_give_the_median_of_those_there_are_and_say_so():
    from tests.support.lab.report_records import job_record

    history = report.history_frame([job_record("1", "m", 10, recorded_at=1), job_record("2", "m", 12, recorded_at=2)])
    reference = report.history_reference(history, report.current_runs(history), 5)
    assert reference.loc[0, "performance"] == "10"
    assert "asked for 5" in reference.loc[0, "baseline"]


def test_a_baseline_is_last_n_a_recorded_job_or_a_file(tmp_path):
    results = _history_dir(tmp_path, 100)
    assert report.parse_baseline("last:3", results) == report.Baseline("last", count=3)
    assert report.parse_baseline("101", results) == report.Baseline("job", "101")
    assert report.parse_baseline("ref.csv", results) == report.Baseline("file", "ref.csv")
    (tmp_path / "reference").write_text("model,performance,metric\n")
    assert report.parse_baseline(str(tmp_path / "reference"), results).kind == "file"


@pytest.mark.parametrize("text", ["last:0", "last:x", "last", "999"])
def test_a_baseline_that_is_none_is_refused_saying_what_to_give(tmp_path, text):
    with pytest.raises(report.ReportError, match="last:N"):
        report.parse_baseline(text, _history_dir(tmp_path, 100))


def test_the_regression_threshold_lies_below_a_rate_and_above_a_time():
    assert report.regression_threshold(100, 0.05, "tokens/sec") == pytest.approx(95)
    assert report.regression_threshold(100, 0.05, "latency_ms") == pytest.approx(105)


def test_report_compare_last_3_exits_one_when_the_newest_is_10_percent_below_the_median_of_the_3_before(
    tmp_path, capsys
):
    results = _history_dir(tmp_path, 104, 100, 96, 90)
    code = main(["report", "--results-dir", str(results), "--compare", "--baseline", "last:3", "--tolerance", "5%"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL" in out and "-10.00%" in out and "median of 3 run(s): job(s) 101, 102, 103" in out


def test_report_compare_last_3_exits_zero_within_the_tolerance(tmp_path, capsys):
    results = _history_dir(tmp_path, 104, 100, 96, 97)
    code = main(["report", "--results-dir", str(results), "--compare", "--baseline", "last:3", "--tolerance", "5%"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS" in out and "-3.00%" in out


def test_report_compare_last_n_judges_a_latency_rise(tmp_path, capsys):
    results = _history_dir(tmp_path, 10, 10, 10, 11, metric="latency_ms")
    assert main(["report", "--results-dir", str(results), "--baseline", "last:3"]) == 1
    assert "worse by 10.00%" in capsys.readouterr().out


def test_report_compare_alone_takes_the_median_of_the_last_5(tmp_path, capsys):
    results = _history_dir(tmp_path, 50, 100, 100, 100, 100, 100, 90)
    assert main(["report", "--results-dir", str(results), "--compare"]) == 1
    assert "median of 5 run(s): job(s) 102, 103, 104, 105, 106" in capsys.readouterr().out


def test_report_compare_of_a_job_uses_only_the_runs_before_it(tmp_path, capsys):
    results = _history_dir(tmp_path, 100, 100, 100, 80, 200, 200, 200)
    assert main(["report", "--results-dir", str(results), "--job", "104", "--baseline", "last:3"]) == 1
    out = capsys.readouterr().out
    assert "median of 3 run(s): job(s) 101, 102, 103" in out


def test_report_compare_with_a_job_baseline(tmp_path, capsys):
    results = _history_dir(tmp_path, 100, 120, 93)
    assert main(["report", "--results-dir", str(results), "--baseline", "101", "--tolerance", "5%"]) == 1
    assert main(["report", "--results-dir", str(results), "--baseline", "101", "--tolerance", "10%"]) == 0
    assert "job 101" in capsys.readouterr().out


def test_a_failed_newest_run_fails_the_comparison(tmp_path, capsys):
    results = _history_dir(tmp_path, 100, 100, 100, None)
    assert main(["report", "--results-dir", str(results), "--baseline", "last:3"]) == 1
    assert "the latest run is FAILURE" in capsys.readouterr().out


@pytest.mark.parametrize("baseline", [[], ["--baseline", "last:3"]], ids=["default-baseline", "last-3"])
def test_a_failed_newest_run_with_no_earlier_run_fails_the_comparison(tmp_path, capsys, baseline):
    results = _history_dir(tmp_path, None)
    assert main(["report", "--results-dir", str(results), "--compare", *baseline]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "the latest run is FAILURE" in out and "NEW" not in out


def test_a_model_without_an_earlier_successful_run_is_new_and_passes(tmp_path, capsys):
    results = _history_dir(tmp_path, None, 100)
    assert main(["report", "--results-dir", str(results), "--baseline", "last:3"]) == 0
    assert "NEW" in capsys.readouterr().out


def test_report_compare_of_one_model_leaves_the_others_out(tmp_path, capsys):
    from tests.support.lab.report_records import job_record, write_records

    results = _history_dir(tmp_path, 100, 100, 100, 100)
    write_records(
        results, job_record("200", "other", 1, recorded_at=1.9e9), job_record("201", "other", 0.5, recorded_at=2e9)
    )
    assert main(["report", "--results-dir", str(results), "--baseline", "last:3"]) == 1
    assert main(["report", "--results-dir", str(results), "--baseline", "last:3", "--model", "m"]) == 0
    assert "other" not in capsys.readouterr().out.split("Compared with")[-1]


def test_report_refuses_two_baselines(tmp_path, capsys):
    results = _history_dir(tmp_path, 100)
    code = main(["report", "--results-dir", str(results), "--compare", "ref.csv", "--baseline", "last:3"])
    assert code == 2
    assert "give one" in capsys.readouterr().err


def test_report_refuses_a_job_id_that_would_leave_the_records(tmp_path, capsys):
    results = _history_dir(tmp_path, 100)
    assert main(["report", "--results-dir", str(results), "--job", "../101"]) == 2
    assert "job" in capsys.readouterr().err.lower()
