"""`slurm-multi report --html` of real lab jobs, opened in a real headless browser (Debian's chromium, driven by
Playwright with its own executable: no `playwright install` download), offline.

Four jobs run through the real pipeline into one results dir (dummy_lastrank three times, for the comparison, and
dummy_fail), two in each pipeline mode, and one report renders them all: the records of both modes' collection
(the controller's play in push mode, collect.yml on the batch host in pull mode) side by side in each model's
history. The page must load with no console error and no request but the file itself, show every node's lane in
every job's timeline and every job in each model's history, and leave a screenshot (its path is printed;
tests/artifacts/ is not tracked).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ansible import BIN, ROOT, ansible_env
from tests.support.lab.per_mode_jobs import in_mode
from tests.support.lab.pipeline import run_pipeline
from tests.support.lab.report_records import job_record, write_records

# The report renders records, whichever mode collected them: one series whose records come from both modes serves
# every test once (mode_independent), in place of a series per mode.
pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "tests" / "artifacts"
# (model, mode), one job after the other: the comparison's newest run and its two before it in both modes.
JOBS = (("dummy_lastrank", "push"), ("dummy_fail", "pull"), ("dummy_lastrank", "pull"), ("dummy_lastrank", "push"))
MODELS = tuple(model for model, _ in JOBS)


@pytest.fixture(scope="module")
def lab_jobs(lab_cluster, tmp_path_factory):
    """(results dir, [(job ID, model)]): the four jobs, one after the other in one results dir."""
    results = tmp_path_factory.mktemp("html-report") / "results"
    ran = []
    for model, mode in JOBS:
        before = {path.name for path in results.iterdir()} if results.exists() else set()
        run = run_pipeline(results, mode=mode, nodelist="node[1-3]", model_tags=[model])
        assert (run.rc == 0) == (model != "dummy_fail"), run.output[-3000:]
        in_mode(run, mode, run.output)
        (job_id,) = {path.name for path in run.job_dirs} - before
        ran.append((job_id, model))
    return results, ran


def _browser_page(html_file: Path, screenshot: Path | None = None):
    """Open the file in headless chromium; returns (requests, console errors, page errors, facts), where facts
    are what `_read` found on the page while it was open."""
    if not CHROMIUM.exists():
        pytest.fail("the browser test needs Debian's chromium: apt-get install -y chromium (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    requests, console_errors, page_errors, dialogs = [], [], [], []
    with sync_playwright() as playwright:
        # --no-sandbox: the lab tests run as root, where chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda request: requests.append(request.url))
            page.on("console", lambda message: message.type == "error" and console_errors.append(message.text))
            page.on("pageerror", lambda error: page_errors.append(str(error)))
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.goto(html_file.as_uri(), wait_until="load")
            facts = _read(page)
            facts["dialogs"] = dialogs
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return requests, console_errors, page_errors, facts


def _read(page) -> dict:
    """Per job section its timeline's node lanes and chart size; per model section its history's job labels."""
    facts = {"jobs": {}, "histories": {}, "scripts": page.locator("script").count()}
    for section in page.locator("section.job").all():
        chart = section.locator(".chart.timeline svg")
        facts["jobs"][section.get_attribute("data-job")] = {
            "lanes": section.locator('.chart.timeline g[id*="-node-"] text').all_text_contents(),
            "chart": chart.bounding_box() if chart.count() else None,
        }
    for section in page.locator("section.history").all():
        chart = section.locator(".chart.history svg")
        facts["histories"][section.get_attribute("data-model")] = {
            "jobs": section.locator('.chart.history g[id*="-job-"] text').all_text_contents(),
            "chart": chart.bounding_box() if chart.count() else None,
            "title": section.locator("h3").inner_text(),
        }
    return facts


def _visible(box) -> bool:
    return box is not None and box["width"] > 200 and box["height"] > 100


def test_the_html_report_of_the_lab_jobs_opens_offline_showing_every_node_and_job(lab_jobs, capsys):
    results, ran = lab_jobs
    html_file = results.parent / "report.html"
    written = subprocess.run(
        [str(BIN / "slurm-multi"), "report", "--results-dir", str(results), "--html", str(html_file), "--job"]
        + [job for job, _ in ran],
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert written.returncode == 0, written.stdout + written.stderr
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "html-report.png"
    requests, console_errors, page_errors, facts = _browser_page(html_file, screenshot)
    with capsys.disabled():
        print(f"\nHTML report: {html_file}\nscreenshot: {screenshot}")

    assert requests == [html_file.as_uri()], "the page asked for more than itself"
    assert console_errors == [] and page_errors == [], (console_errors, page_errors)
    assert facts["scripts"] == 0
    assert list(facts["jobs"]) == [job for job, _ in ran]
    for job, shown in facts["jobs"].items():
        # The job's own nodes, rank order: a lab grown beyond three nodes may give a job node2-node4.
        per_node = json.loads((results / "records" / f"{job}.json").read_text())["per_node"]
        ranks = sorted((verdict["rank"], node) for node, verdict in per_node.items())
        assert len(ranks) == 3 and shown["lanes"] == [f"{node} (r{rank})" for rank, node in ranks], job
        assert _visible(shown["chart"]), (job, shown["chart"])
    for model in dict.fromkeys(MODELS):
        shown = facts["histories"][model]
        assert shown["jobs"] == [job for job, ran_model in ran if ran_model == model], model
        assert _visible(shown["chart"]), (model, shown["chart"])
    assert screenshot.stat().st_size > 20_000


def test_the_report_compares_the_newest_lab_run_with_the_ones_before(lab_jobs):
    results, ran = lab_jobs
    compared = subprocess.run(
        [str(BIN / "slurm-multi"), "report", "--results-dir", str(results), "--compare", "--baseline", "last:2"]
        + ["--model", "dummy_lastrank", "--tolerance", "5%"],
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # dummy_lastrank prints the same figure every run: it passes against the median of the two runs before it.
    assert compared.returncode == 0, compared.stdout + compared.stderr
    first, second, last = [job for job, model in ran if model == "dummy_lastrank"]
    assert f"median of 2 run(s): job(s) {first}, {second}" in compared.stdout
    assert "PASS" in compared.stdout and last in compared.stdout


def test_a_model_name_holding_a_script_runs_nothing_in_the_browser(tmp_path):
    hostile = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'
    results = write_records(
        tmp_path / "results", job_record("7", hostile, 5, recorded_at=1.8e9), job_record("8", hostile, 6)
    )
    html_file = tmp_path / "report.html"
    written = subprocess.run(
        [str(BIN / "slurm-multi"), "report", "--results-dir", str(results), "--html", str(html_file)],
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert written.returncode == 0, written.stdout + written.stderr
    requests, console_errors, page_errors, facts = _browser_page(html_file)
    assert requests == [html_file.as_uri()]  # the <img src=x> stayed text
    assert facts["dialogs"] == [] and facts["scripts"] == 0
    assert console_errors == [] and page_errors == []
    assert facts["histories"][hostile]["title"] == hostile


def _flame_graph(path: Path) -> None:
    """A real py-spy flame graph (py-spy record of a second of Python work), as the pyspy_record tool writes one."""
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import find_pyspy

    work = "import time\nend = time.time() + 1\nwhile time.time() < end: sum(range(1000))"
    subprocess.run(
        [find_pyspy(), "record", "--output", str(path), "--rate", "50", "--", sys.executable, "-c", work],
        check=True,
        capture_output=True,
        timeout=60,
    )


def test_a_hung_jobs_report_names_the_stuck_rank_and_its_links_open_the_stacks_and_the_flame_graph(tmp_path):
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import collect_job
    from tests.support.lab.hang_results import NODES, write_hung_job

    results = tmp_path / "results"
    outputs = {node: {"tools": ["pyspy_record"], "tool_outputs": [f"tools/pyspy-rank{rank}.svg"]} for rank, node in
               enumerate(NODES)}  # fmt: skip
    attempt_dir = write_hung_job(results, status_fields=outputs)
    graph = attempt_dir / "nodes" / "node3" / "tools" / "pyspy-rank2.svg"
    graph.parent.mkdir()
    _flame_graph(graph)
    collect_job(str(results), "42", {"name": "ddp_hang"}, NODES)
    html_file = tmp_path / "report.html"
    written = subprocess.run(
        [str(BIN / "slurm-multi"), "report", "--results-dir", str(results), "--html", str(html_file), "--job", "42"],
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert written.returncode == 0, written.stdout + written.stderr
    if not CHROMIUM.exists():
        pytest.fail("the browser test needs Debian's chromium: apt-get install -y chromium (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(html_file.as_uri(), wait_until="load")
            hang = page.locator("section.job .hang")
            assert hang.get_attribute("data-stuck-ranks") == "2"
            assert "rank 2 (node3) is stuck in load_batch (ddp_hang.py:22)" in hang.locator("strong").inner_text()

            page.get_by_role("link", name="node3: nodes/node3/stacks.txt").click()
            page.wait_for_load_state()
            assert page.url == (attempt_dir / "nodes" / "node3" / "stacks.txt").as_uri()
            assert "load_batch (/myworkspace/scripts/hang/ddp_hang.py:22)" in page.inner_text("body")

            page.go_back()
            page.get_by_role("link", name="rank 2 flame graph").click()
            page.wait_for_load_state()
            assert page.url == graph.as_uri()
            assert page.evaluate("document.documentElement.tagName") == "svg"
            assert "py-spy record" in page.locator("#title").text_content()
        finally:
            browser.close()
