"""`slurm-multi report`: the perf table, and the comparison with a reference that passes or fails each model."""

import pytest

from slurm_multi import report
from slurm_multi.cli import main

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
