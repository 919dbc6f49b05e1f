"""Specification of the `performance:` line parser and the error-pattern scan."""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.perf_lines import (
    DEFAULT_ERROR_PATTERNS,
    parse_performance_line,
    scan_log,
    scan_log_file,
)


# The run module reads a log once (`scan_log_file`): these views of one scan state each behaviour alone.
def parse_performance_lines(log):
    return scan_log(log).perf_lines


def count_performance_lines(log):
    return len(scan_log(log).perf_lines)


def find_error_pattern(log, patterns=DEFAULT_ERROR_PATTERNS, benign=()):
    return scan_log(log, patterns, benign).error_pattern


@pytest.mark.parametrize(
    "line, value, raw, metric",
    [
        # Megatron-LM / Primus: the last rank prints the throughput, behind torchrun's rank prefix.
        ("[rank15]: performance: 10123.4 tokens/sec/GPU", 10123.4, "10123.4", "tokens/sec/GPU"),
        ("[rank7]:[2025-06-01 10:00:00,123] INFO performance: 522.1 TFLOPS/GPU", 522.1, "522.1", "TFLOPS/GPU"),
        ("[default3]:performance: 1.0123E+04 tok/s", 10123.0, "1.0123E+04", "tok/s"),
        # vLLM / SGLang benchmark wrappers.
        ("INFO 06-01 10:00:00 [bench.py:42] performance: 5977 tok/s", 5977.0, "5977", "tok/s"),
        ("performance: 12.5 requests/s, 5977.3 tok/s total", 12.5, "12.5", "requests/s"),
        # torchvision-style training scripts.
        ("Performance: 1520.33 samples_per_second", 1520.33, "1520.33", "samples_per_second"),
        ("PERFORMANCE: 88 img/s", 88.0, "88", "img/s"),
        # Number shapes.
        ("performance: 1.23E+4 tokens/sec", 12300.0, "1.23E+4", "tokens/sec"),
        ("performance: 5e-3 s/iter", 0.005, "5e-3", "s/iter"),
        ("performance: 12,345.6 tok/s", 12345.6, "12,345.6", "tok/s"),
        ("performance:42 ms", 42.0, "42", "ms"),
        ("performance :  3.0   tok/s", 3.0, "3.0", "tok/s"),
        # Noise around it.
        ("\x1b[1;32mperformance: 9.5 tok/s\x1b[0m", 9.5, "9.5", "tok/s"),
        ("2025-06-01T10:00:00Z node3 python[123]: performance: 4 it/s", 4.0, "4", "it/s"),
        ("performance: 4 tok/s;", 4.0, "4", "tok/s"),
    ],
)
def test_performance_line_is_parsed_from_real_world_shapes(line, value, raw, metric):
    perf = parse_performance_line(line)
    assert perf is not None, line
    assert (perf.value, perf.raw, perf.metric) == (pytest.approx(value), raw, metric)


@pytest.mark.parametrize(
    "line",
    [
        "performance: 123",  # no metric: a row without its unit compares with nothing
        "performance: N/A tok/s",
        "performance: nan tok/s",
        "performance: inf tok/s",
        "performance: 12,34 tok/s",  # not a thousands grouping: refused rather than read as 12
        "performance: 1234,567 tok/s",
        "performance: 5tok/s",
        "avg_performance: 3 tok/s",  # another key that merely ends in "performance"
        "the performance was 3 tok/s",
        "performance: , tok/s",
        "",
    ],
)
def test_line_that_is_not_a_performance_line_is_ignored(line):
    assert parse_performance_line(line) is None


@pytest.mark.parametrize(
    "line, raw",
    [
        ("performance: -1 samples_per_second", "-1"),  # a script's failure marker
        ("performance: 0 tok/s", "0"),
        ("performance: -.5 delta", "-.5"),
        ("performance: +7 x", "+7"),  # a figure is plain: no sign
        ("performance: 1e999 tok/s", "1e999"),  # overflows to inf
    ],
)
def test_a_line_whose_number_is_no_figure_is_a_performance_line_without_a_value(line, raw):
    # Still a performance line: the log's last one then makes a row that says why it holds no figure.
    perf = parse_performance_line(line)
    assert (perf.value, perf.raw) == (None, raw)


def test_cleaned_line_is_kept_as_evidence():
    perf = parse_performance_line("\x1b[32m  [rank1]: performance: 3 tok/s  \x1b[0m\n")
    assert perf.line == "[rank1]: performance: 3 tok/s"


def test_carriage_return_ends_a_progress_bar_line():
    log = "step 1/3\rstep 2/3\rstep 3/3 performance: 7 tok/s\r\nperformance: 8 tok/s"
    assert [perf.value for perf in parse_performance_lines(log)] == [7.0, 8.0]


def test_performance_lines_keep_log_order():
    log = "performance: 1 tok/s\nnoise\nperformance: 3 tok/s\nperformance: 2 tok/s\n"
    assert [perf.value for perf in parse_performance_lines(log)] == [1.0, 3.0, 2.0]


def test_performance_lines_are_counted_from_an_open_file_line_by_line(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("".join(f"[rank0]: iteration {i}\nperformance: {i} tok/s\n" for i in range(1000)))
    with open(log) as handle:
        assert count_performance_lines(handle) == 1000


def test_a_log_without_performance_lines_counts_zero():
    assert count_performance_lines("training...\nloss: 1.2\n") == 0


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("Traceback (most recent call last):", "Traceback (most recent call last)"),
        ("[rank1]: RuntimeError: NCCL communicator was aborted", "RuntimeError:"),
        ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB", "OutOfMemoryError"),
        ("CUDA out of memory. Tried to allocate 20.00 MiB", "CUDA out of memory"),
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp", "DistBackendError"),
        ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "ChildFailedError"),
        ("  train.py FAILED ... failed (exitcode: -9)", "failed (exitcode:"),
        ("ModuleNotFoundError: No module named 'apex'", "ModuleNotFoundError:"),
        ("bash: line 1:  42 Segmentation fault      (core dumped) python train.py", "Segmentation fault"),
    ],
)
def test_default_error_pattern_finds_a_real_failure(line, pattern):
    assert find_error_pattern("starting\n" + line + "\nexiting\n") == pattern


@pytest.mark.parametrize(
    "line",
    [
        "errors: 0",
        "Error rate: 0.00%",
        "validation loss errors=0 | skipped: 0 | nan iterations: 0",
        "[rank0]: no error found in checkpoint",
        "collective_errors: 0 FAILED: 0",
        "performance: 3 tok/s",
    ],
)
def test_default_error_patterns_ignore_healthy_lines(line):
    assert find_error_pattern(line) is None


def test_default_error_patterns_leave_out_bare_error_words():
    assert not {"Error", "error", "ERROR", "FAILED"} & set(DEFAULT_ERROR_PATTERNS)


def test_performance_line_is_never_an_error_line():
    assert find_error_pattern("performance: 3 RuntimeError:/s", ["RuntimeError:"]) is None


def test_benign_substring_excuses_its_line_only():
    log = "RuntimeError: retrying download (benign)\nall good\n"
    assert find_error_pattern(log, benign=["retrying download"]) is None
    assert find_error_pattern(log + "RuntimeError: boom\n", benign=["retrying download"]) == "RuntimeError:"


def test_custom_patterns_replace_the_defaults_and_are_literal():
    log = "Traceback (most recent call last):\nsomething [x] happened\n"
    assert find_error_pattern(log, ["[x]"]) == "[x]"
    assert find_error_pattern(log, ["s.mething"]) is None


def test_error_pattern_is_found_through_ansi_colours():
    assert find_error_pattern("\x1b[31mRuntime\x1b[0mError: boom") == "RuntimeError:"


def test_scan_reports_perf_lines_and_the_first_error_in_one_pass():
    scan = scan_log("performance: 1 tok/s\nImportError: no x\nRuntimeError: y\nperformance: 2 tok/s\n")
    assert [perf.value for perf in scan.perf_lines] == [1.0, 2.0]
    assert (scan.error_pattern, scan.error_line) == ("ImportError:", "ImportError: no x")


def test_scan_of_a_log_file_survives_undecodable_bytes(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"\xff\xfe garbage\nperformance: 4 tok/s\n")
    scan = scan_log_file(str(log))
    assert [perf.value for perf in scan.perf_lines] == [4.0]
    assert scan.error_pattern is None


def test_colour_codes_inside_the_label_do_not_hide_a_performance_line():
    assert parse_performance_line("\x1b[1mperf\x1b[0mormance: 2 tok/s").value == 2.0
