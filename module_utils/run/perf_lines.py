"""What a model's log says about its run: ``performance: <number> <metric>`` lines and error patterns
(docs/contracts.md). Error patterns are literal substrings, never matched on a performance line."""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Union

DEFAULT_ERROR_PATTERNS = (
    "Traceback (most recent call last)",
    "RuntimeError:",
    "OutOfMemoryError",
    "CUDA out of memory",
    "HIP out of memory",
    "DistBackendError",
    "ChildFailedError",
    "failed (exitcode:",
    "ModuleNotFoundError:",
    "ImportError:",
    "AssertionError:",
    "Segmentation fault",
)

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

# ASCII digits only: str patterns' \d matches every script's digits, and float() reads them.
_NUMBER = (
    r"[+-]?"
    r"(?:"
    r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?"  # thousands-grouped: 12,345 or 12,345.6
    r"|[0-9]+(?:\.[0-9]*)?"  # 123, 123., 123.45
    r"|\.[0-9]+"  # .5
    r")"
    r"(?:[eE][+-]?[0-9]+)?"
)
# A figure's whole text: the number above without sign or grouping.
_FIGURE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")

_PERFORMANCE_LINE = re.compile(
    r"(?<![A-Za-z0-9_])performance\s*:\s*(?P<number>" + _NUMBER + r")\s+(?P<metric>\S+)",
    re.IGNORECASE,
)


def figure_problem(value: Any) -> Optional[str]:
    """Why a performance value (a CSV cell, a log line's number) is no figure; None when it is one."""
    text = str(value if value is not None else "").strip()
    if not text:
        return "empty"
    if _FIGURE.fullmatch(text) is None:
        return "negative" if text.startswith("-") and _FIGURE.fullmatch(text[1:]) else "not a plain decimal number"
    figure = float(text)
    if not math.isfinite(figure):
        return "not finite"
    return "zero" if figure == 0 else None


def performance_figure(value: Any) -> Optional[float]:
    """The figure a performance value holds (see `figure_problem`), else None."""
    return None if figure_problem(value) is not None else float(str(value).strip())


class PerfLine(NamedTuple):
    """One ``performance:`` line: its figure (None when its number is no figure, `figure_problem` says why), the
    number as printed, the metric token and the cleaned line."""

    value: Optional[float]
    raw: str
    metric: str
    line: str


def _without_ansi(line: str) -> str:
    return _ANSI_ESCAPE.sub("", line) if "\x1b" in line else line


def parse_performance_line(line: str) -> Optional[PerfLine]:
    """The performance line in one log line (no newlines in it), or None when it holds none."""
    cleaned = _without_ansi(line)
    # A cheap test first: logs run to millions of lines and almost none of them is a performance line.
    if "performance" not in cleaned.lower():
        return None
    cleaned = cleaned.strip()
    match = _PERFORMANCE_LINE.search(cleaned)
    if match is None:
        return None
    raw = match.group("number")
    # A metric followed by a separator ("tok/s, elapsed 3 s") does not own the separator.
    metric = match.group("metric").rstrip(",;")
    if not metric:
        return None
    return PerfLine(value=performance_figure(raw.replace(",", "")), raw=raw, metric=metric, line=cleaned)


def _log_lines(text_or_lines: Union[str, Iterable[str]]) -> Iterable[str]:
    # str.splitlines splits on \r too: a progress bar's last redraw is its own line.
    if isinstance(text_or_lines, str):
        return text_or_lines.splitlines()
    return (piece for chunk in text_or_lines for piece in chunk.splitlines())


def _error_pattern_in_line(line: str, patterns: Sequence[str], benign: Sequence[str]) -> Optional[str]:
    hit = next((pattern for pattern in patterns if pattern and pattern in line), None)
    if hit is None:
        return None
    if any(harmless and harmless in line for harmless in benign) or parse_performance_line(line) is not None:
        return None
    return hit


class LogScan(NamedTuple):
    """One pass over a log: its performance lines, the first error pattern and the line that held it."""

    perf_lines: List[PerfLine]
    error_pattern: Optional[str]
    error_line: Optional[str]


def scan_log(
    text_or_lines: Union[str, Iterable[str]],
    patterns: Sequence[str] = DEFAULT_ERROR_PATTERNS,
    benign: Sequence[str] = (),
) -> LogScan:
    """Performance lines and the first error pattern of a log in a single pass (logs can be gigabytes)."""
    perf_lines = []  # type: List[PerfLine]
    error_pattern = None
    error_line = None
    for line in _log_lines(text_or_lines):
        perf = parse_performance_line(line)
        if perf is not None:
            perf_lines.append(perf)
            continue
        if error_pattern is None:
            error_pattern = _error_pattern_in_line(_without_ansi(line), patterns, benign)
            if error_pattern is not None:
                error_line = _without_ansi(line).strip()
    return LogScan(perf_lines, error_pattern, error_line)


def scan_log_file(path: str, patterns: Sequence[str] = DEFAULT_ERROR_PATTERNS) -> LogScan:
    """`scan_log` over a log file, read line by line; undecodable bytes are replaced, never fatal."""
    with open(path, encoding="utf-8", errors="replace") as log:
        return scan_log(log, patterns)
