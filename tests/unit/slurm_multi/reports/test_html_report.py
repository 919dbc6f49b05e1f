"""`slurm-multi report --html`: one self-contained page, record texts escaped, every node and job in the charts."""

import re
from html.parser import HTMLParser

import pytest

from slurm_multi.cli import main
from slurm_multi.reports import html as html_report
from slurm_multi.reports import text as report
from tests.support.lab.report_records import NODES, job_record, write_records

HOSTILE = '<script>alert("x")</script> $\\alpha$ & co'


class _Page(HTMLParser):
    """The elements and attributes of a page, and per section its SVG texts as (id of their group, text)."""

    def __init__(self):
        super().__init__()
        self.tags, self.attributes, self.sections = [], [], {}
        self._section, self._group, self._in_text = None, "", False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes += attrs
        attrs = dict(attrs)
        if tag == "section":
            self._section = attrs.get("data-job") or attrs.get("data-model")
            self.sections[self._section] = []
        if tag == "g":
            self._group = attrs.get("id") or ""
        self._in_text = tag == "text"

    def handle_endtag(self, tag):
        self._in_text = False

    def handle_data(self, data):
        if self._in_text and self._section is not None:
            self.sections[self._section].append((self._group, data))

    def texts(self, section, kind=""):
        """The section's SVG texts; with ``kind`` ("node", "job"), only its lane or tick labels of that kind."""
        return [text for group, text in self.sections[section] if re.search(f"-{kind}-\\d+$", group) or not kind]


def _results(tmp_path):
    return write_records(
        tmp_path / "results",
        job_record("101", "dummy", 100, recorded_at=1.8e9),
        job_record("102", "dummy", 104, recorded_at=1.8e9 + 60),
        job_record("103", "dummy", "", status="FAILURE", recorded_at=1.8e9 + 120),
        job_record("104", "dummy", 98, recorded_at=1.8e9 + 180),
        job_record("105", HOSTILE, 5, recorded_at=1.8e9 + 240),
    )


def _page(tmp_path, *args, code=0):
    target = tmp_path / "report.html"
    assert main(["report", "--results-dir", str(_results(tmp_path)), "--html", str(target), *args]) == code
    text = target.read_text()
    page = _Page()
    page.feed(text)
    return text, page


def test_the_page_is_self_contained_and_runs_no_script(tmp_path):
    text, page = _page(tmp_path)
    assert "script" not in page.tags and "iframe" not in page.tags and "img" not in page.tags
    links = [value for name, value in page.attributes if name in ("src", "href", "xlink:href", "action")]
    assert links and all(value.startswith("#") for value in links), links
    assert not re.search(r"url\(\s*['\"]?(?!#)", text), "a style fetches something"
    assert "@import" not in text and "@font-face" not in text
    assert "default-src 'none'" in text  # the CSP: no script, no fetch, whatever the page holds


def test_a_model_name_with_a_script_tag_is_shown_as_text(tmp_path):
    text, page = _page(tmp_path)
    assert "<script" not in text.lower()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    # Kept literally in the charts: no mathtext ('$\\alpha$' stays as written).
    assert HOSTILE in page.texts(HOSTILE)


def test_every_jobs_timeline_shows_every_node(tmp_path):
    _, page = _page(tmp_path)
    for job in ("101", "102", "103", "104", "105"):
        assert page.texts(job, "node") == [f"{node} (r{rank})" for rank, node in enumerate(NODES)], job


def test_the_history_chart_shows_every_job_with_the_baseline_and_the_verdict(tmp_path):
    text, page = _page(tmp_path, "--baseline", "last:2", "--tolerance", "5%")
    history = page.texts("dummy")
    assert page.texts("dummy", "job") == ["101", "102", "103", "104"]
    # Job 104 (98) against the median of 101 and 102 (102): -3.92%, within 5%.
    assert "baseline 102" in history and "baseline \u00b1 5.0%" in history
    assert "PASS</span> -3.92%" in text


def test_a_regression_is_shown_failed_in_the_history(tmp_path):
    text, _ = _page(tmp_path, "--baseline", "last:2", "--tolerance", "2%", code=1)
    assert "FAIL</span> -3.92% worse by 3.92% (tolerance 2.00%)" in text


def test_jobs_and_model_choose_the_sections(tmp_path):
    text, page = _page(tmp_path, "--job", "102", "104", "--model", "dummy")
    assert [name for name in page.sections if name in ("101", "102", "103", "104", "105")] == ["102", "104"]
    assert HOSTILE not in page.sections


def test_a_record_without_step_times_says_so(tmp_path):
    old = job_record("201", "dummy", 1)
    del old["timeline"]
    results = write_records(tmp_path / "results", old)
    page, _ = html_report.render_report(results)
    assert "holds no step times" in page


def test_an_unknown_job_is_refused_by_name(tmp_path, capsys):
    results = _results(tmp_path)
    assert main(["report", "--results-dir", str(results), "--html", str(tmp_path / "r.html"), "--job", "999"]) == 2
    assert "no record of job(s) 999" in capsys.readouterr().err


def test_an_empty_results_dir_is_refused(tmp_path):
    with pytest.raises(report.ReportError, match="nothing to report"):
        html_report.render_report(tmp_path)


def test_a_reference_file_is_the_html_reports_baseline_too(tmp_path):
    reference = tmp_path / "reference.csv"
    reference.write_text("model,performance,metric\ndummy,120,tokens/sec\n")
    text, page = _page(tmp_path, "--compare", str(reference), "--model", "dummy", code=1)
    assert "baseline 120" in page.texts("dummy")
    assert "FAIL</span> -18.33%" in text


def test_a_sweeps_record_brings_the_history_of_its_models(tmp_path):
    results = _results(tmp_path)
    sweep = job_record("300", "dummy", 99, recorded_at=1.9e9)
    sweep["sweep"] = [{"index": 0, "job_id": "300.0", "model": "dummy", "status": "SUCCESS", "reason": ""}]
    write_records(results, sweep)
    page, _ = html_report.render_report(results, jobs=["300"])
    assert 'data-model="dummy"' in page


# --- A hung run and MAD's tools (the record's hang, each node's tool_outputs) ---------------------------------------


class _Links(HTMLParser):
    """Every link of a page: [(href, its text)]."""

    def __init__(self):
        super().__init__()
        self.links, self._href = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self.links.append([self._href, ""])

    def handle_endtag(self, tag):
        self._href = None if tag == "a" else self._href

    def handle_data(self, data):
        if self._href is not None:
            self.links[-1][1] += data


def _hung_job(tmp_path):
    """A hung 3-node run with the pyspy_record tool and one more output per node, collected: its results dir."""
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import collect_job
    from tests.support.lab.hang_results import NODES as HUNG_NODES
    from tests.support.lab.hang_results import write_hung_job

    results = tmp_path / "results"
    tools = {
        node: {"tools": ["pyspy_record"], "tool_outputs": ["tools/rocprof.csv", f"tools/pyspy-rank{rank}.svg"]}
        for rank, node in enumerate(HUNG_NODES)
    }
    write_hung_job(results, status_fields=tools)
    collect_job(str(results), "42", {"name": "ddp_hang"}, HUNG_NODES)
    return results


def _links(page):
    parser = _Links()
    parser.feed(page)
    return {text: href for href, text in parser.links if not (href or "#").startswith("#")}


def test_a_hung_jobs_section_names_the_stuck_rank(tmp_path):
    page, _ = html_report.render_report(_hung_job(tmp_path), jobs=["42"], links_from=tmp_path)
    assert 'data-stuck-ranks="2"' in page
    summary = "rank 2 (node3) is stuck in load_batch (ddp_hang.py:22) while ranks 0 and 1 wait in all_reduce"
    assert f"<strong>{summary}</strong>" in page


def test_the_hang_section_links_each_nodes_stacks_file_relative_to_the_report(tmp_path):
    results = _hung_job(tmp_path)
    links = _links(html_report.render_report(results, jobs=["42"], links_from=tmp_path)[0])
    for node in ("node1", "node2", "node3"):
        href = links[f"{node}: nodes/{node}/stacks.txt"]
        assert (tmp_path / href).resolve() == (results / "42" / "attempt-0" / "nodes" / node / "stacks.txt").resolve()


def test_each_ranks_flame_graph_is_linked_by_its_rank_and_the_other_outputs_are_listed(tmp_path):
    results = _hung_job(tmp_path)
    links = _links(html_report.render_report(results, jobs=["42"], links_from=tmp_path)[0])
    node3 = results / "42" / "attempt-0" / "nodes" / "node3"
    assert (tmp_path / links["rank 2 flame graph"]).resolve() == (node3 / "tools" / "pyspy-rank2.svg").resolve()
    assert "tools/rocprof.csv" in links


def test_without_the_reports_own_path_the_links_are_file_urls(tmp_path):
    results = _hung_job(tmp_path)
    links = _links(html_report.render_report(results, jobs=["42"])[0])
    stacks = results / "42" / "attempt-0" / "nodes" / "node1" / "stacks.txt"
    assert links["node1: nodes/node1/stacks.txt"] == stacks.absolute().as_uri()


@pytest.mark.parametrize("planted", ["../../../../etc/passwd", "/etc/passwd"])
def test_a_path_in_a_record_that_would_leave_its_attempt_dir_gets_no_link(tmp_path, planted):
    record = job_record("9", "dummy", "", status="FAILURE")
    record["hang"] = {"kind": "unknown", "summary": "x", "stacks": {"node1": planted}}
    page, _ = html_report.render_report(write_records(tmp_path / "results", record), links_from=tmp_path)
    assert _links(page) == {} and f"node1: {planted}" in page


def test_the_report_written_to_a_file_links_relative_to_its_directory(tmp_path):
    results = _hung_job(tmp_path)
    target = tmp_path / "reports" / "report.html"
    target.parent.mkdir()
    assert main(["report", "--results-dir", str(results), "--html", str(target), "--job", "42"]) == 0
    href = _links(target.read_text())["node2: nodes/node2/stacks.txt"]
    assert href == "../results/42/attempt-0/nodes/node2/stacks.txt"
