"""`slurm-multi report --html`: one self-contained HTML file a performance engineer opens first.

For each job chosen: its verdict, a hung run's finding, a per-node table, MAD's tools' outputs, its perf rows and
its stage timeline as a Gantt chart; for each model of those jobs, its perf history with the baseline and tolerance
band of `report --compare`. Offline: matplotlib's SVG and the style sheet inline, no JavaScript, and a
Content-Security-Policy forbidding scripts and every fetch, so an edited page or a record text that slipped past the
escaping can neither run code nor reach the network. The only links are to the job's own files, relative to the
report's directory, so a report written into the results dir moves with it.
"""

import datetime
import html
import io
import math
import os
import re
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pandas as pd

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import STEPS, duration, valid_steps
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.timeline import straggler_lines
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.finding import ranks_text
from slurm_multi.reports import text as report
from slurm_multi.reports.job_view import summary_lines

# Without --job, the newest jobs get a section of their own; the history charts cover every job all the same.
MAX_JOBS = 10
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_STATUS_CLASS = {"SUCCESS": "ok", "SKIPPED": "skip", "PASS": "ok", "NEW": "skip"}
_STYLE = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
.badge { display: inline-block; padding: 0.05em 0.5em; border-radius: 0.3em; color: #fff; background: #b00020; }
.badge.ok { background: #1b7f3b; } .badge.skip { background: #777; }
.note { color: #555; font-size: 0.9em; } .chart svg { max-width: 100%; height: auto; }
ul.lines { font-family: monospace; font-size: 0.9em; }
"""


@dataclass(frozen=True)
class WrittenReport:
    path: str
    summary: str


def write_report(
    path: str | Path,
    results_dir: str | Path,
    jobs: Sequence[str] = (),
    model: str | None = None,
    baseline: report.Baseline | None = None,
    tolerance: float = 0.05,
) -> WrittenReport:
    """Write the HTML report to ``path`` (replacing it); raises report.ReportError naming what is wrong."""
    target = Path(path)
    page, summary = render_report(results_dir, jobs, model, baseline, tolerance, links_from=target.absolute().parent)
    if target.is_dir():
        raise report.ReportError(f"--html {path} is a directory: give the file to write, e.g. {target / 'report.html'}")
    temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temp.write_text(page, encoding="utf-8")
        os.replace(temp, target)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise report.ReportError(f"cannot write the HTML report {path}: {exc.strerror or exc}") from None
    return WrittenReport(str(target), summary)


def render_report(
    results_dir: str | Path,
    jobs: Sequence[str] = (),
    model: str | None = None,
    baseline: report.Baseline | None = None,
    tolerance: float = 0.05,
    now: float | None = None,
    links_from: str | Path | None = None,
) -> tuple[str, str]:
    """The page, and a one-line summary of what it shows. Links to the jobs' files are relative to ``links_from``
    (the directory the page is written to), else absolute file:// URLs."""
    baseline = baseline or report.parse_baseline(report.DEFAULT_BASELINE, results_dir)
    records, skipped = report.read_records(results_dir)
    history = report.history_frame(records)
    by_id = {str(record.get("job_id")): record for record in records}
    chosen, note = _chosen_jobs(by_id, history, jobs, model)
    # From the records' rows: a sweep's record is no run of the history, yet its rows name its models.
    named = [name for record in chosen for name in _record_models(record)]
    models = [model] if model is not None else list(dict.fromkeys(named))
    if not chosen and not models:
        raise report.ReportError(f"no job recorded in {results_dir}: nothing to report")

    body = [
        "<h1>slurm-multi report</h1>",
        f'<p class="note">Results dir {_e(results_dir)}; written {_e(_when(now))}. Baseline: {_e(baseline.describe())},'
        f" tolerance {tolerance:.2%}. {_e(note)}</p>",
    ]
    body += [f'<p class="note">Skipped an unreadable record: {_e(line)}</p>' for line in skipped]
    if chosen:
        body.append(_jobs_overview(chosen))
    links = _FileLinks(Path(results_dir), Path(links_from) if links_from is not None else None)
    for index, record in enumerate(chosen):
        body.append(_job_section(record, index, links))
    if models:
        body.append("<h2>Performance history</h2>")
        body.append(
            '<p class="note">Every job of the results dir that ran the model, oldest recorded first. The shaded band '
            "is the baseline &plusmn; the tolerance; beyond the dashed line a run fails the comparison.</p>"
        )
    for index, name in enumerate(models):
        body.append(_history_section(history, name, jobs, baseline, tolerance, index))
    summary = f"{len(chosen)} job(s), history of {len(models)} model(s)"
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>slurm-multi report: {_e(summary)}</title><style>{_STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    return page, summary


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _when(epoch: float | None) -> str:
    moment = datetime.datetime.fromtimestamp(time.time() if epoch is None else epoch, datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _chosen_jobs(
    by_id: Mapping[str, dict], history: pd.DataFrame, jobs: Sequence[str], model: str | None
) -> tuple[list[dict], str]:
    if jobs:
        missing = [job for job in jobs if job not in by_id]
        if missing:
            raise report.ReportError(f"no record of job(s) {', '.join(missing)} in the results dir's records/")
        return [by_id[job] for job in dict.fromkeys(jobs)], ""
    runs = history if model is None else history[history["model"] == model]
    if model is not None and runs.empty:
        raise report.ReportError(f"no recorded run of model {model!r}")
    ids = list(dict.fromkeys(runs["job_id"]))
    note = f"The newest {MAX_JOBS} of {len(ids)} jobs have a section (--job chooses)." if len(ids) > MAX_JOBS else ""
    return [by_id[job] for job in ids[-MAX_JOBS:]], note


def _badge(status) -> str:
    return f'<span class="badge {_STATUS_CLASS.get(str(status), "")}">{_e(status)}</span>'


def _table(header: Sequence[str], rows: Sequence[Sequence], raw_columns: Sequence[int] = ()) -> str:
    """A table; every cell escaped but those of ``raw_columns`` (HTML this module made)."""
    head = "".join(f"<th>{_e(name)}</th>" for name in header)
    body = "".join(
        "<tr>"
        + "".join(f"<td>{cell if index in raw_columns else _e(cell)}</td>" for index, cell in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _record_models(record: Mapping) -> list[str]:
    return list(dict.fromkeys(str(row.get("model")) for row in record.get("rows") or [] if isinstance(row, Mapping)))


def _jobs_overview(records: Sequence[Mapping]) -> str:
    rows = [
        (
            f'<a href="#job-{_anchor(record.get("job_id"))}">{_e(record.get("job_id"))}</a>',
            ", ".join(_record_models(record)),
            _badge(record.get("status")),
            _when(report.recorded_at(record)) if not math.isnan(report.recorded_at(record)) else "",
            len(record.get("nodes") or record.get("per_node") or ()),
        )
        for record in records
    ]
    return "<h2>Jobs</h2>" + _table(("job", "model", "verdict", "recorded", "nodes"), rows, raw_columns=(0, 2))


def _anchor(text) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(text))


@dataclass(frozen=True)
class _FileLinks:
    """Hrefs to the files a record names in its attempt dir."""

    results_dir: Path
    links_from: Path | None

    def attempt_file(self, record: Mapping, relative) -> str | None:
        """The href of ``relative`` (a path in the record's attempt dir); None for one that would leave it."""
        inside = PurePosixPath(str(relative))
        if not str(relative) or inside.is_absolute() or ".." in inside.parts:
            return None
        try:
            attempt = job_layout.attempt_dir(str(self.results_dir), str(record.get("job_id")), record.get("attempt", 0))
        except job_layout.JobLayoutError:
            return None
        path = os.path.abspath(os.path.join(attempt, *inside.parts))
        if self.links_from is None:
            return Path(path).as_uri()
        # Quoted: a ':' in a node's name must not read as a URL's scheme.
        return urllib.parse.quote(os.path.relpath(path, os.path.abspath(self.links_from)))


def _link(href: str | None, text) -> str:
    return f'<a href="{_e(href)}">{_e(text)}</a>' if href else _e(text)


def _hang_section(record: Mapping, links: _FileLinks) -> list[str]:
    """A hung run's finding (module_utils/run/hang/finding.py): who is stuck, who waits, each node's stacks."""
    hang = record.get("hang")
    if not isinstance(hang, Mapping):
        return []
    stuck = [rank for rank in hang.get("stuck_ranks") or [] if isinstance(rank, int)]
    facts = [f"kind: {hang.get('kind', 'unknown')}"]
    for key, label in (("stuck_ranks", "stuck"), ("waiting_ranks", "waiting"), ("never_joined", "never joined")):
        if hang.get(key):
            facts.append(f"{label}: {ranks_text(hang[key])}")
    stacks = hang.get("stacks") if isinstance(hang.get("stacks"), Mapping) else {}
    items = "".join(
        f"<li>{_link(links.attempt_file(record, path), f'{node}: {path}')}</li>" for node, path in stacks.items()
    )
    return [
        f'<div class="hang" data-stuck-ranks="{_e(",".join(map(str, stuck)))}">',
        "<h3>Hang</h3>",
        f"<p><strong>{_e(hang.get('summary', ''))}</strong></p>",
        f'<p class="note">{_e("; ".join(facts))}</p>',
        f"<p>Each node's stacks (every process of its container, secrets masked):</p><ul>{items}</ul>" if items else "",
        "</div>",
    ]


_FLAME_GRAPH = re.compile(r"^tools/pyspy-rank(\d+)(?:-pid\d+)?\.svg$")


def _tools_section(record: Mapping, nodes: Sequence[str], per_node: Mapping, links: _FileLinks) -> list[str]:
    """MAD's tools each node applied and their outputs; each rank's py-spy flame graph named as such."""
    rows = []
    for node in nodes:
        verdict = per_node.get(node) if isinstance(per_node.get(node), Mapping) else {}
        outputs = [str(output) for output in verdict.get("tool_outputs") or []]
        if not outputs and not verdict.get("tools"):
            continue
        hrefs = []
        for output in sorted(outputs, key=lambda name: (not _FLAME_GRAPH.match(name), name)):
            graph = _FLAME_GRAPH.match(output)
            text = f"rank {graph.group(1)} flame graph" if graph else output
            hrefs.append(_link(links.attempt_file(record, f"nodes/{node}/{output}"), text))
        rows.append(
            (node, verdict.get("rank", ""), ", ".join(map(str, verdict.get("tools") or [])), "<br>".join(hrefs))
        )
    if not rows:
        return []
    return ["<h3>Tools</h3>", _table(("node", "rank", "tools", "outputs"), rows, raw_columns=(3,))]


def _job_section(record: Mapping, index: int, links: _FileLinks) -> str:
    job_id = str(record.get("job_id"))
    timeline = record.get("timeline") if isinstance(record.get("timeline"), Mapping) else {}
    timeline = {str(node): valid_steps(steps) for node, steps in timeline.items()}
    per_node = record.get("per_node") if isinstance(record.get("per_node"), Mapping) else {}
    nodes = list(dict.fromkeys([*map(str, record.get("nodes") or []), *map(str, per_node), *timeline]))
    listed = list(nodes)
    nodes.sort(key=lambda node: (_rank(per_node.get(node)), listed.index(node)))
    steps = [step for step in STEPS if any(step in timeline.get(node, {}) for node in nodes)]
    waits = record.get("barrier_wait") if isinstance(record.get("barrier_wait"), Mapping) else {}
    node_rows = []
    for node in nodes:
        verdict = per_node.get(node) if isinstance(per_node.get(node), Mapping) else {}
        node_steps = timeline.get(node, {})
        node_rows.append(
            [
                node,
                verdict.get("rank", ""),
                _badge(verdict.get("status", "?")),
                "yes" if verdict.get("root_cause") else "",
                verdict.get("reason", ""),
                _seconds(waits.get(node)),
            ]
            + [_seconds(duration(node_steps[step])) if step in node_steps else "-" for step in steps]
        )
    perf_columns = ("model", "performance", "metric", "nnodes", "status")
    perf_rows = [
        [row.get(key, "") for key in perf_columns] for row in record.get("rows") or [] if isinstance(row, Mapping)
    ]
    lines = straggler_lines(timeline) + summary_lines(record.get("perf_summary") or {})
    attempts = record.get("attempts") or []
    facts = [
        f"Model: {', '.join(_record_models(record)) or '(no perf rows)'}",
        f"attempt {record.get('attempt', 0)}" + (f" of {len(attempts)}" if len(attempts) > 1 else ""),
    ]
    if record.get("slurm_state"):
        facts.append(f"SLURM state {record.get('slurm_state')}")
    if not math.isnan(report.recorded_at(record)):
        facts.append(f"recorded {_when(report.recorded_at(record))}")
    parts = [
        f'<section class="job" id="job-{_anchor(job_id)}" data-job="{_e(job_id)}">',
        f"<h2>Job {_e(job_id)} {_badge(record.get('status'))}</h2>",
        f"<p>{_e(record.get('reason', ''))}</p>",
        f'<p class="note">{_e("; ".join(facts))}</p>',
        *_hang_section(record, links),
        "<h3>Nodes</h3>",
        _table(
            ["node", "rank", "verdict", "root cause", "reason", "barrier wait (s)"] + [f"{step} (s)" for step in steps],
            node_rows,
            raw_columns=(2,),
        ),
        *_tools_section(record, nodes, per_node, links),
    ]
    if perf_rows:
        parts += ["<h3>Performance</h3>", _table(("model", "performance", "metric", "nodes", "status"), perf_rows)]
    parts.append("<h3>Stage timeline</h3>")
    if any(timeline.values()):
        parts.append(f'<div class="chart timeline">{timeline_svg(timeline, nodes, per_node, f"t{index}")}</div>')
    else:
        parts.append('<p class="note">This record holds no step times (recorded before nodes recorded them).</p>')
    if lines:
        parts.append('<ul class="lines">' + "".join(f"<li>{_e(line)}</li>" for line in lines) + "</ul>")
    parts.append("</section>")
    return "\n".join(parts)


def _rank(verdict) -> int:
    rank = verdict.get("rank") if isinstance(verdict, Mapping) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else 1 << 30


def _seconds(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def _history_section(
    history: pd.DataFrame,
    model: str,
    jobs: Sequence[str],
    baseline: report.Baseline,
    tolerance: float,
    index: int,
) -> str:
    runs = history[history["model"] == model].reset_index(drop=True)
    parts = [f'<section class="history" data-model="{_e(model)}">', f"<h3>{_e(model)}</h3>"]
    if runs.empty:
        return "\n".join(parts + ['<p class="note">No recorded run of this model.</p>', "</section>"])
    in_jobs = [job for job in jobs if job in set(runs["job_id"])]
    current = report.current_runs(history, in_jobs, model)
    reference = report.baseline_reference(history, current, baseline, model)
    comparison = report.compare_with_reference(current.drop(columns="value"), reference, tolerance)
    verdict = comparison.iloc[0] if not comparison.empty else None
    ref_value = report.parse_figure(reference["performance"].iloc[-1]) if not reference.empty else None
    metric = str(current["metric"].iloc[0])
    baseline_jobs = _baseline_jobs(history, current.iloc[0], baseline)
    chart = history_svg(
        model, runs, metric, str(current["job_id"].iloc[0]), ref_value, tolerance, baseline_jobs, f"h{index}"
    )
    parts.append(f'<div class="chart history">{chart}</div>')
    if verdict is not None:
        parts.append(
            f"<p>Job {_e(current['job_id'].iloc[0])} against {_e(verdict.get('baseline') or baseline.describe())}: "
            f"{_badge(verdict['result'])} {_e(verdict['change'])} {_e(verdict['note'])}</p>"
        )
    rows = []
    for run in runs.itertuples():
        recorded = _when(run.recorded_at) if not math.isnan(run.recorded_at) else ""
        rows.append((run.job_id, recorded, run.performance, run.metric, run.nnodes, run.status))
    table = _table(("job", "recorded", "performance", "metric", "nodes", "status"), rows)
    # A long history's table is folded (a <details> opens without JavaScript); the chart shows it all.
    parts += [
        f"<details{' open' if len(rows) <= 10 else ''}><summary>Every run ({len(rows)})</summary>{table}</details>"
    ]
    parts.append("</section>")
    return "\n".join(parts)


def _baseline_jobs(history: pd.DataFrame, run: Mapping, baseline: report.Baseline) -> list[str]:
    if baseline.kind == "last":
        return list(report.earlier_successes(history, run).tail(baseline.count)["job_id"])
    return [baseline.value] if baseline.kind == "job" else []


# --- Charts: matplotlib's SVG, inlined -------------------------------------------------------------------------------

_STEP_COLOURS = {
    "preflight": "#9e9e9e",
    "build": "#1f77b4",
    "publish": "#17becf",
    "load": "#ff7f0e",
    "barrier": "#d62728",
    "container_start": "#8c564b",
    "run": "#2ca02c",
    "diagnostics": "#9467bd",
}


# Beside the chart, on its right.
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1), "fontsize": "small", "frameon": False}


def _charts(salt: str):
    """matplotlib's settings for one chart: text kept as SVG text (no font files, searchable), never read as
    mathtext (a '$' in a model's name is just a '$'), and ids of its own (two inlined SVGs must not share a clip
    path's id)."""
    import matplotlib

    return matplotlib.rc_context(
        {"svg.fonttype": "none", "svg.hashsalt": f"slurm-multi-{salt}", "text.parse_math": False}
    )


def _svg(figure) -> str:
    """The figure as an <svg> element to inline, without its metadata."""
    out = io.StringIO()
    figure.savefig(
        out, format="svg", bbox_inches="tight", metadata={"Creator": None, "Date": None, "Format": None, "Type": None}
    )
    text = out.getvalue()
    return text[text.index("<svg") :]


def _figure(width: float, height: float):
    # A Figure of its own (no pyplot): no global state, no GUI backend, safe in any thread.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def timeline_svg(timeline: Mapping[str, Mapping], nodes: Sequence[str], per_node: Mapping, salt: str) -> str:
    """The Gantt chart: one lane per node (rank 0 on top), one bar per step, seconds from the first step."""
    with _charts(salt):
        starts = [times["start"] for steps in timeline.values() for times in steps.values()]
        origin = min(starts)
        figure = _figure(9, 0.45 * len(nodes) + 1.4)
        axes = figure.subplots()
        shown = []
        for lane, node in enumerate(nodes):
            for step in STEPS:
                times = timeline.get(node, {}).get(step)
                if times is None:
                    continue
                bars = axes.broken_barh(
                    [(times["start"] - origin, max(duration(times), 0.05))],
                    (lane - 0.35, 0.7),
                    facecolors=_STEP_COLOURS[step],
                    label=step if step not in shown else None,
                )
                bars.set_gid(f"{salt}-bar-{lane}-{step}")
                if step not in shown:
                    shown.append(step)
        labels = []
        for node in nodes:
            rank = _rank(per_node.get(node))
            labels.append(str(node if rank == 1 << 30 else f"{node} (r{rank})"))
        axes.set_yticks(range(len(nodes)), labels)
        for lane, label in enumerate(axes.get_yticklabels()):
            label.set_gid(f"{salt}-node-{lane}")  # the page's readers (and its test) find each node's lane by it
        axes.set_ylim(len(nodes) - 0.5, -0.5)
        axes.set_xlabel("seconds from the job's first step")
        axes.grid(axis="x", alpha=0.3)
        handles, names = axes.get_legend_handles_labels()
        order = sorted(range(len(names)), key=lambda i: STEPS.index(names[i]))
        axes.legend([handles[i] for i in order], [names[i] for i in order], **_LEGEND)
        return _svg(figure)


def history_svg(
    model: str,
    runs: pd.DataFrame,
    metric: str,
    current_job: str,
    reference: float | None,
    tolerance: float,
    baseline_jobs: Sequence[str],
    salt: str,
) -> str:
    """The model's figure in each job (oldest left; failed runs marked on the axis), the baseline's value as a line
    over the runs it covers up to the run judged, its tolerance band, and the line beyond which a run fails."""
    with _charts(salt):
        figure = _figure(9, 3.6)
        axes = figure.subplots()
        positions = list(range(len(runs)))
        good = runs["value"].notna() & (runs["metric"] == metric)
        xs = [p for p, ok in zip(positions, good, strict=True) if ok]
        ys = [v for v, ok in zip(runs["value"], good, strict=True) if ok]
        if xs:
            axes.plot(xs, ys, marker="o", color="#1f77b4", label=str(metric or "figure"))
        failed = [p for p, status in zip(positions, runs["status"], strict=True) if status not in ("", "SUCCESS")]
        if reference is not None and math.isfinite(reference):
            job_positions = {job: p for p, job in enumerate(runs["job_id"])}
            span = [job_positions[job] for job in (*baseline_jobs, current_job) if job in job_positions]
            left, right = (min(span), max(span)) if span else (0, len(runs) - 1)
            left, right = left - 0.3, right + 0.3
            margin = tolerance * abs(reference)
            axes.fill_between(
                [left, right],
                reference - margin,
                reference + margin,
                color="#ffbf00",
                alpha=0.25,
                label=f"baseline \u00b1 {tolerance:.1%}",
            )
            axes.plot([left, right], [reference, reference], color="#b36b00", label=f"baseline {reference:.6g}")
            threshold = report.regression_threshold(reference, tolerance, metric)
            axes.plot([left, right], [threshold, threshold], color="#b00020", linestyle="--", label="regression beyond")
        if current_job in set(runs["job_id"]):
            position = list(runs["job_id"]).index(current_job)
            value = runs["value"].iloc[position]
            if not math.isnan(value):
                axes.plot(
                    [position],
                    [value],
                    marker="o",
                    markersize=11,
                    markerfacecolor="none",
                    color="#222",
                    linestyle="none",
                    label="run judged",
                )
        if failed:
            bottom = min(ys) if ys else 0.0
            axes.plot(
                failed,
                [bottom] * len(failed),
                marker="x",
                color="#b00020",
                linestyle="none",
                markersize=9,
                label="failed run",
            )
        axes.set_xticks(
            positions,
            [str(job) for job in runs["job_id"]],
            rotation=45 if len(runs) > 8 else 0,
            ha="right" if len(runs) > 8 else "center",
            fontsize="small",
        )
        for position, label in enumerate(axes.get_xticklabels()):
            label.set_gid(f"{salt}-job-{position}")
        if len(runs) > 40:  # a long history: every label would overlap; keep about 40
            step = math.ceil(len(runs) / 40)
            for number, label in enumerate(axes.get_xticklabels()):
                label.set_visible(number % step == 0 or number == len(runs) - 1)
        axes.set_xlim(-0.6, len(runs) - 0.4)
        axes.set_xlabel("job")
        axes.set_ylabel(str(metric))
        axes.set_title(model, loc="left", fontsize="medium")
        axes.grid(axis="y", alpha=0.3)
        axes.legend(**_LEGEND)
        return _svg(figure)
