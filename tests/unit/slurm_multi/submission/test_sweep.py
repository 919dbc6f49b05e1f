"""Sweeps: several images (models, or a model's Dockerfile variants) in one allocation, one run and record each.

The spec and the job script (what a submit plans), the sweep's driver with a stand-in for one model's pipeline run
(each test says what that run leaves), the sweep's record and perf.csv, and the build stage's manifest entry.
"""

import json

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import write_build_failures
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, SUCCESS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_sweep import (
    cards_of_manifest,
    collect_job_or_sweep,
    new_sweep_plan,
    record_sweep,
    sub_job_id,
    write_sweep_plan,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import load_record
from plugins.filter.manifest_image import manifest_image_reference
from slurm_multi.errors import SlurmMultiError
from slurm_multi.spec import job_spec
from slurm_multi.submission.sbatch import SlurmOptions, render_job_script
from slurm_multi.submission.submit import check_time_limit, plan_submission
from slurm_multi.submission.sweep import run_sweep, sweep_manifest_path
from tests.unit.module_utils.results.test_results_collection import NODES, read_perf_csv, write_clean_job, write_node

THREE = ["dummy", "dummy_lastrank", "dummy_multiple_results"]


# ---------------------------------------------------------------------------------------------------------------
# What a submit plans


def test_tags_selecting_several_models_make_a_sweep_in_one_job(tmp_path):
    spec = job_spec(THREE, results_dir=tmp_path)
    assert [card["name"] for card in spec.sweep] == THREE
    job_vars = spec.job_vars()
    assert [card["name"] for card in job_vars["sweep_models"]] == THREE and job_vars["stop_on_failure"] is False
    plan = plan_submission(spec, SlurmOptions(nodes=3), private_dir=tmp_path / "private")
    # One job script runs every model: the sweep's driver around the pipeline.
    assert "-m slurm_multi.submission.sweep --vars-file" in plan.job_script
    assert '-- "$ANSIBLE_PLAYBOOK" "$PLAYBOOKS/run_multi.yml"' in plan.job_script


def test_one_model_is_no_sweep_and_its_job_script_runs_the_pipeline_itself(tmp_path):
    spec = job_spec(["dummy"], results_dir=tmp_path)
    assert spec.sweep == () and "sweep_models" not in spec.job_vars()
    for mode in ("push", "pull"):
        script = render_job_script(
            SlurmOptions(nodes=2), tmp_path, tmp_path / "ap", tmp_path / "v", tmp_path, tmp_path, mode
        )
        assert "slurm_multi.submission.sweep" not in script


def test_pull_mode_sweep_runs_the_pull_step_once_per_model(tmp_path):
    script = render_job_script(
        SlurmOptions(nodes=3), tmp_path, tmp_path / "ap", tmp_path / "v", tmp_path, tmp_path, "pull", True
    )
    assert "-m slurm_multi.submission.sweep" in script and "-- srun --nodes=3" in script


def test_a_model_whose_context_filter_keeps_two_dockerfiles_is_a_sweep_of_both(tmp_path):
    spec = job_spec(["dummy_ctxtest"], results_dir=tmp_path, additional_context='{"ctx_test": 2}')
    assert [card["dockerfile"].rsplit("/", 2)[-2:] for card in spec.sweep] == [
        ["docker", "dummy_ctxtest.ctx2a.Dockerfile"],
        ["docker", "dummy_ctxtest.ctx2b.Dockerfile"],
    ]
    # The filter narrows it to one image: no sweep.
    assert job_spec(["dummy_ctxtest"], results_dir=tmp_path, additional_context='{"ctx_test": 1}').sweep == ()


def test_a_model_with_no_fitting_dockerfile_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(SlurmMultiError, match="no Dockerfile fits the run context"):
        job_spec(["dummy", "dummy_ctxtest"], results_dir=tmp_path, additional_context='{"ctx_test": 3}')


def test_a_time_limit_below_the_models_timeouts_is_refused_before_submitting(tmp_path):
    spec = job_spec(THREE, results_dir=tmp_path)  # 600 s each
    with pytest.raises(SlurmMultiError, match=r"1800 s by their timeouts .* --time 20 gives 1200 s"):
        check_time_limit(spec, SlurmOptions(nodes=3, time="20"))
    with pytest.raises(SlurmMultiError, match="1800 s"):
        plan_submission(spec, SlurmOptions(nodes=3, time="20"), private_dir=tmp_path / "p")
    check_time_limit(spec, SlurmOptions(nodes=3, time="40"))
    check_time_limit(spec, SlurmOptions(nodes=3))  # no limit: nothing to check


def test_the_time_limit_advice_is_in_the_units_time_takes_and_that_value_passes(tmp_path):
    spec = job_spec(THREE, results_dir=tmp_path)  # 600 s each: 30 minutes
    with pytest.raises(SlurmMultiError) as refused:
        check_time_limit(spec, SlurmOptions(nodes=3, time="20"))
    assert "raise --time to at least 00:30:00 (30 minutes) plus the build" in str(refused.value)
    check_time_limit(spec, SlurmOptions(nodes=3, time="00:30:00").validated())  # the advice itself is taken


def test_a_prebuilt_image_with_several_models_is_refused(tmp_path):
    with pytest.raises(SlurmMultiError, match="one model's image"):
        job_spec(THREE, results_dir=tmp_path, use_image="busybox:latest")


# ---------------------------------------------------------------------------------------------------------------
# The build stage picks this run's image of the sweep's manifest


def test_manifest_image_reference_takes_the_sweep_runs_image():
    manifest = {
        "built_images": {"ci-a": {"registry_image": "r/a:1"}, "ci-b": {"registry_image": "r/b:1"}},
        "built_models": {"ci-a": {"name": "a"}, "ci-b": {"name": "b"}},
    }
    assert manifest_image_reference(manifest) == "ci-a"
    assert manifest_image_reference(manifest, False, 1) == "ci-b"
    assert manifest_image_reference(manifest, True, 1) == "r/b:1"
    with pytest.raises(Exception, match="no image 3"):
        manifest_image_reference(manifest, False, 2)


# ---------------------------------------------------------------------------------------------------------------
# The driver, the sweep's record and perf.csv


def _manifest(cards):
    return {
        "built_images": {f"ci-{card['name']}": {"docker_image": f"ci-{card['name']}"} for card in cards},
        "built_models": {f"ci-{card['name']}": card for card in cards},
        "context": {},
    }


def _stand_in_run(results_dir, attempt, failing=(), builds=None, failed_builds=()):
    """One model's pipeline run: the first writes the sweep's manifest (``builds``' cards) and the images that
    failed to build (``failed_builds``' names), each leaves its nodes' files (``failing`` models exit 1 on node2)
    and collects its own record, as run_multi.yml does."""
    calls = []

    def run_model(model, run_vars):
        calls.append(run_vars)
        if model["index"] == 1 and builds is not None:
            path = run_vars["sweep_manifest"]
            with open(path, "w") as handle:
                json.dump(_manifest(builds), handle)
        if model["index"] == 1 and failed_builds:
            failures = [
                {
                    "model": name,
                    "dockerfile": "",
                    "image_name": f"ci-{name}",
                    "error": f"docker build of ci-{name} failed",
                }
                for name in failed_builds
            ]
            write_build_failures(run_vars["sweep_manifest"], failures)
        write_clean_job(results_dir, run_vars["job_id"], attempt=attempt)
        if model["model"] in failing:
            status = json.loads(
                (results_dir / run_vars["job_id"] / f"attempt-{attempt}/nodes/node2/status.json").read_text()
            )
            status.update(exit_code=1, status=FAILURE, reason="exit 1")
            write_node(results_dir, run_vars["job_id"], "node2", status, attempt=attempt)
        collect_job_or_sweep(
            str(results_dir), run_vars["job_id"], model=run_vars["collect_model"], nodes=NODES, attempt=attempt
        )
        return 0

    return run_model, calls


def test_a_sweep_runs_every_model_under_its_own_job_id_and_records_each(tmp_path):
    cards = [{"name": name} for name in THREE]
    run_model, calls = _stand_in_run(tmp_path, 0, builds=cards)
    lines = []
    record = run_sweep(str(tmp_path), "77", 0, cards, run_model, nodes=NODES, on_progress=lines.append)
    assert [call["job_id"] for call in calls] == ["77.1", "77.2", "77.3"]
    # The first run builds into the sweep's manifest; the later ones run from it.
    assert "manifest_path" not in calls[0]
    assert calls[1]["manifest_path"] == calls[2]["manifest_path"] == sweep_manifest_path(str(tmp_path), "77", 0)
    assert [call["sweep_index"] for call in calls] == [0, 1, 2]
    assert record["status"] == SUCCESS and [entry["status"] for entry in record["sweep"]] == [SUCCESS] * 3
    assert "slurm-multi: model 2 of 3: dummy_lastrank (job 77.2)" in lines
    for index, name in enumerate(THREE, start=1):
        assert load_record(str(tmp_path), f"77.{index}", 0)["rows"][0]["model"] == name
    # perf.csv: each model's row once (the sweep's record repeats them for its reader, not for perf.csv).
    _, rows = read_perf_csv(tmp_path)
    assert sorted(row["model"] for row in rows) == sorted(THREE)
    assert len(load_record(str(tmp_path), "77")["rows"]) == 3


def test_a_failing_model_does_not_stop_the_sweep_but_fails_it(tmp_path):
    cards = [{"name": name} for name in ["dummy", "dummy_fail", "dummy_lastrank"]]
    run_model, calls = _stand_in_run(tmp_path, 0, failing={"dummy_fail"}, builds=cards)
    record = run_sweep(str(tmp_path), "78", 0, cards, run_model, nodes=NODES, on_progress=lambda _: None)
    assert len(calls) == 3
    assert [entry["status"] for entry in record["sweep"]] == [SUCCESS, FAILURE, SUCCESS]
    assert record["status"] == FAILURE
    assert "1 of 3 models failed: model 2 of 3 dummy_fail (job 78.2)" in record["reason"]


def test_stop_on_failure_records_the_models_it_did_not_run(tmp_path):
    cards = [{"name": name} for name in ["dummy", "dummy_fail", "dummy_lastrank"]]
    run_model, calls = _stand_in_run(tmp_path, 0, failing={"dummy_fail"}, builds=cards)
    record = run_sweep(
        str(tmp_path), "79", 0, cards, run_model, stop_on_failure=True, nodes=NODES, on_progress=lambda _: None
    )
    assert len(calls) == 2
    third = load_record(str(tmp_path), "79.3", 0)
    assert third["status"] == FAILURE and "dummy_fail) failed and the sweep stops on failure" in third["reason"]
    assert record["status"] == FAILURE and [entry["status"] for entry in record["sweep"]] == [SUCCESS, FAILURE, FAILURE]


def test_the_sweep_runs_what_the_build_made_when_the_nodes_narrowed_the_variants(tmp_path):
    planned = [{"name": "m", "dockerfile": "a"}, {"name": "m", "dockerfile": "b"}, {"name": "n"}]
    built = [{"name": "m", "dockerfile": "a"}, {"name": "n"}]
    run_model, calls = _stand_in_run(tmp_path, 0, builds=built)
    record = run_sweep(str(tmp_path), "80", 0, planned, run_model, nodes=NODES, on_progress=lambda _: None)
    assert [call["job_id"] for call in calls] == ["80.1", "80.2"]
    assert [entry["model"] for entry in record["sweep"]] == ["m", "n"] and record["status"] == SUCCESS


def test_a_variants_card_names_the_dockerfile_its_image_was_built_from():
    manifest = {
        "built_images": {"ci-m_a": {"dockerfile": "/zoo/docker/m.a.Dockerfile"}, "ci-m_b": {"dockerfile": "/zoo/m.b"}},
        "built_models": {
            "ci-m_a": {"name": "m", "dockerfile": "docker/m"},
            "ci-m_b": {"name": "m", "dockerfile": "docker/m"},
        },
    }
    assert [card["dockerfile"] for card in cards_of_manifest(manifest)] == ["/zoo/docker/m.a.Dockerfile", "/zoo/m.b"]


def test_a_failed_build_runs_no_further_model(tmp_path):
    cards = [{"name": name} for name in THREE]
    run_model, calls = _stand_in_run(tmp_path, 0, builds=None)
    record = run_sweep(str(tmp_path), "81", 0, cards, run_model, nodes=NODES, on_progress=lambda _: None)
    assert len(calls) == 1
    assert "the sweep's build failed" in load_record(str(tmp_path), "81.2", 0)["reason"]
    assert record["status"] == FAILURE


def test_an_image_that_fails_to_build_is_recorded_not_run_and_the_others_still_run(tmp_path):
    cards = [{"name": name} for name in ["dummy", "dummy_broken", "dummy_lastrank"]]
    built = [cards[0], cards[2]]
    run_model, calls = _stand_in_run(tmp_path, 0, builds=built, failed_builds=["dummy_broken"])
    lines = []
    record = run_sweep(str(tmp_path), "82", 0, cards, run_model, nodes=NODES, on_progress=lines.append)
    # Each run takes its own image from the manifest, which names only the images built.
    assert [(call["job_id"], call["sweep_index"]) for call in calls] == [("82.1", 0), ("82.2", 1)]
    assert [(entry["model"], entry["status"]) for entry in record["sweep"]] == [
        ("dummy", SUCCESS),
        ("dummy_lastrank", SUCCESS),
        ("dummy_broken", FAILURE),
    ]
    broken = load_record(str(tmp_path), "82.3", 0)
    assert broken["reason"].startswith("not run: its image failed to build: docker build of ci-dummy_broken failed")
    assert record["status"] == FAILURE and any("dummy_broken: failed to build" in line for line in lines)


def test_when_the_first_image_fails_to_build_its_run_is_recorded_and_the_others_run(tmp_path):
    cards = [{"name": name} for name in ["dummy_broken", "dummy", "dummy_lastrank"]]
    run_model, calls = _stand_in_run(
        tmp_path, 0, failing={"dummy_broken"}, builds=cards[1:], failed_builds=["dummy_broken"]
    )
    record = run_sweep(str(tmp_path), "83", 0, cards, run_model, nodes=NODES, on_progress=lambda _: None)
    assert [(call["job_id"], call["sweep_index"]) for call in calls] == [("83.1", 0), ("83.2", 0), ("83.3", 1)]
    assert [(entry["model"], entry["status"]) for entry in record["sweep"]] == [
        ("dummy_broken", FAILURE),
        ("dummy", SUCCESS),
        ("dummy_lastrank", SUCCESS),
    ]


def test_stop_on_failure_stops_at_an_image_that_failed_to_build(tmp_path):
    cards = [{"name": name} for name in ["dummy", "dummy_broken", "dummy_lastrank"]]
    run_model, calls = _stand_in_run(tmp_path, 0, builds=[cards[0], cards[2]], failed_builds=["dummy_broken"])
    record = run_sweep(
        str(tmp_path), "84", 0, cards, run_model, stop_on_failure=True, nodes=NODES, on_progress=lambda _: None
    )
    assert len(calls) == 1
    assert [entry["status"] for entry in record["sweep"]] == [SUCCESS, FAILURE, FAILURE]
    assert "build of dummy_broken failed and the sweep stops on failure" in record["reason"]


def test_a_sweep_cut_short_is_recorded_with_why_for_every_model_without_a_record(tmp_path):
    """The afterany collect job's case: the job was cancelled during model 2."""
    plan = new_sweep_plan("82", 0, [{"name": name} for name in THREE], False)
    write_sweep_plan(str(tmp_path), plan)
    write_clean_job(tmp_path, "82.1")
    collect_job_or_sweep(str(tmp_path), "82.1", model={"name": "dummy"}, nodes=NODES, attempt=0)
    write_node(tmp_path, "82.2", "node1", log="training\n")  # model 2 was running: no status yet
    record = record_sweep(str(tmp_path), "82", 0, nodes=NODES, failure_reason="cancelled", slurm_state="CANCELLED")
    assert record["status"] == FAILURE and record["reason"].startswith("cancelled")
    assert [entry["status"] for entry in record["sweep"]] == [SUCCESS, FAILURE, FAILURE]
    assert load_record(str(tmp_path), "82.3", 0)["slurm_state"] == "CANCELLED"


def test_collecting_a_sweep_by_its_job_id_gives_the_sweep_record_not_its_empty_nodes_dir(tmp_path):
    plan = new_sweep_plan("83", 0, [{"name": "dummy"}, {"name": "dummy_lastrank"}], False)
    write_sweep_plan(str(tmp_path), plan)
    for index in (1, 2):
        write_clean_job(tmp_path, f"83.{index}")
    collection = collect_job_or_sweep(str(tmp_path), "83", nodes=NODES, attempt=0)
    assert collection.record["status"] == SUCCESS and len(collection.record["sweep"]) == 2


def test_sub_job_ids_count_from_one():
    assert sub_job_id("4242", 1) == "4242.1"
    with pytest.raises(Exception, match="from 1"):
        sub_job_id("4242", 0)


_STAND_IN_PIPELINE = r"""
import json, os, sys
sys.path[:0] = [os.environ["SWEEP_TEST_ROOT"], os.path.join(os.environ["SWEEP_TEST_ROOT"], "collections")]
from tests.unit.slurm_multi.submission.test_sweep import stand_in_pipeline_run
stand_in_pipeline_run(sys.argv[1:])
"""


def stand_in_pipeline_run(argv):
    """What one run of run_multi.yml leaves, for the job script's driver: its argv ends with ``-e @<model's vars>``."""
    from pathlib import Path

    from slurm_multi.submission.job_vars import read_job_vars

    run_vars = read_job_vars(Path(argv[argv.index("-e", 2) + 1][1:]))
    job_vars = read_job_vars(Path(argv[1][1:]))
    results = Path(job_vars["results_dir"])
    if run_vars["sweep_index"] == 0:
        with open(run_vars["sweep_manifest"], "w") as handle:
            json.dump(_manifest([dict(card) for card in job_vars["sweep_models"]]), handle)
    write_clean_job(results, run_vars["job_id"])
    collect_job_or_sweep(str(results), run_vars["job_id"], model=run_vars["collect_model"], nodes=NODES, attempt=0)


def test_the_job_scripts_driver_runs_the_pipeline_argv_once_per_model_with_its_vars(tmp_path, monkeypatch, capsys):
    import sys
    from pathlib import Path

    from slurm_multi.submission import sweep
    from slurm_multi.submission.job_vars import write_job_vars

    results = tmp_path / "results"
    spec = job_spec(["dummy", "dummy_lastrank"], results_dir=results)
    vars_file = tmp_path / "private" / "vars.json"
    vars_file.parent.mkdir()
    write_job_vars(vars_file, spec.job_vars())
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.setenv("SWEEP_TEST_ROOT", str(Path(__file__).resolve().parents[4]))
    argv = ["--vars-file", str(vars_file), "--ansible-playbook", "/nonexistent", "--playbooks", str(tmp_path)]
    pipeline = [sys.executable, "-c", _STAND_IN_PIPELINE, "-e", f"@{vars_file}"]
    assert sweep.main([*argv, "--", *pipeline]) == 0
    out = capsys.readouterr().out
    assert "slurm-multi: model 2 of 2: dummy_lastrank (job 4711.2)" in out and "sweep 4711: SUCCESS" in out
    assert [entry["status"] for entry in load_record(str(results), "4711")["sweep"]] == [SUCCESS, SUCCESS]
    # Each model's vars are data in a 0600 file of the job's private dir, never argv.
    assert oct((vars_file.parent / "sweep-0-2.json").stat().st_mode & 0o777) == "0o600"


def test_a_manifest_with_several_images_is_a_sweep_that_builds_nothing(tmp_path):
    manifest = tmp_path / "build_manifest.json"
    manifest.write_text(json.dumps(_manifest([{"name": "dummy"}, {"name": "dummy_lastrank"}])))
    spec = job_spec(["dummy"], results_dir=tmp_path / "results", manifest_path=manifest)
    assert [card["name"] for card in spec.sweep] == ["dummy", "dummy_lastrank"]
    # Every model's run, the first too, takes its image from the given manifest.
    run_model, calls = _stand_in_run(tmp_path / "results", 0)
    (tmp_path / "results").mkdir()
    record = run_sweep(
        str(tmp_path / "results"), "84", 0, spec.sweep, run_model, nodes=NODES, on_progress=lambda _: None,
        manifest=str(manifest),
    )  # fmt: skip
    assert [call["sweep_manifest"] for call in calls] == [str(manifest)] * 2 and record["status"] == SUCCESS


def test_a_sweep_model_without_its_scripts_is_refused_before_anything_runs(tmp_path):
    zoo = tmp_path / "zoo"
    (zoo / "docker").mkdir(parents=True)
    (zoo / "docker" / "m.Dockerfile").write_text("# CONTEXT {}\nFROM scratch\n")
    (zoo / "scripts").mkdir()
    (zoo / "scripts" / "run.sh").write_text("echo performance: 1 x\n")
    cards = [
        {"name": "first", "dockerfile": "docker/m", "scripts": "scripts/run.sh"},
        {"name": "second", "dockerfile": "docker/m", "scripts": "scripts/missing.sh"},
    ]
    (zoo / "models.json").write_text(json.dumps(cards))
    with pytest.raises(SlurmMultiError, match="missing.sh"):
        job_spec(["first", "second"], results_dir=tmp_path, models_file=zoo / "models.json")
    assert len(job_spec(["first"], results_dir=tmp_path, models_file=zoo / "models.json").sweep) == 0
