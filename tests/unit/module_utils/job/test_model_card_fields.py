"""MAD model-card fields: refused when of the wrong type, honoured on the node (n_gpus, timeout, skip_gpu_arch),
and a job whose every node skips the model recorded SKIPPED, not FAILURE."""

import json

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    ManifestError,
    select_model_cards,
    validate_manifest,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job import layout as job_layout
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.model_card_fields import (
    CardFieldError,
    check_card_fields,
    skipped_gpu_arch,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import collect_job
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.verdict import decide_verdict
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run import run_model_container
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRunError,
    card_gpu_indices,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.docker.rank import DockerRuntime
from tests.unit.module_utils.results.test_results_collection import MODEL, NODES, clean_status, write_node

pytest_plugins = ("tests.support.lab.model_run_fixtures",)

CARD = {"name": "m", "dockerfile": "docker/m", "scripts": "scripts/m/run.sh"}
MI250 = [{"index": 0, "arch": "gfx90a", "name": "AMD Instinct MI250X"}, {"index": 1, "arch": "gfx90a"}]
A100 = [{"index": 0, "name": "NVIDIA A100-SXM4-80GB"}]


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("args", ["--batch", "8"], "must be one string of arguments, shell-quoted"),
        ("args", "--name 'unbalanced", "cannot be split into arguments"),
        ("timeout", "an hour", "must be seconds"),
        ("timeout", -5, "must be seconds"),
        ("timeout", True, "must be seconds"),
        ("multiple_results", ["a.csv"], "must be the name of the results CSV"),
        ("n_gpus", "eight", "must be the GPUs per node: -1"),
        ("n_gpus", 2.5, "must be the GPUs per node: -1"),
        ("n_gpus", -2, "must be the GPUs per node: -1"),
        ("skip_gpu_arch", {"gfx90a": True}, "must be a list of strings"),
        ("skip_gpu_arch", ["gfx90a", 942], "must be a list of strings"),
        ("tags", [1, 2], "must be a list of strings"),
    ],
)
def test_a_card_field_of_the_wrong_type_is_refused_naming_model_field_and_value(field, value, expected):
    with pytest.raises(CardFieldError) as error:
        check_card_fields(dict(CARD, **{field: value}))
    assert f"model 'm': {field} {value!r}" in str(error.value) and expected in str(error.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("args", "--batch 8 --name 'a b'"),
        ("timeout", 600),
        ("timeout", "600"),
        ("timeout", -1),
        ("n_gpus", "-1"),
        ("n_gpus", 8),
        ("skip_gpu_arch", "gfx90a,gfx908"),
        ("skip_gpu_arch", ["A100"]),
        ("tags", "pyt,llm"),
        ("multiple_results", ""),
    ],
)
def test_the_forms_mad_gives_card_fields_are_accepted(field, value):
    check_card_fields(dict(CARD, **{field: value}))


def test_a_selected_card_with_a_bad_field_is_refused_when_selected():
    cards = [dict(CARD, args=["--x"]), dict(CARD, name="other", args="fine")]
    assert select_model_cards(cards, ["other"])[0]["name"] == "other"  # the zoo's other cards are not checked
    with pytest.raises(ManifestError, match="model 'm': args"):
        select_model_cards(cards, ["m"])


def test_a_manifest_card_with_a_bad_field_is_refused_naming_the_manifest():
    manifest = {"built_images": {"i": {"docker_image": "i"}}, "built_models": {"i": dict(CARD, timeout="soon")}}
    with pytest.raises(ManifestError, match="build manifest m.json: model 'm': timeout 'soon'"):
        validate_manifest(manifest, "m.json")


@pytest.mark.parametrize(
    "skip, gpus, matched",
    [
        ("gfx90a", MI250, "gfx90a"),
        ("gfx908, gfx90a", MI250, "gfx90a"),
        (["GFX90A"], MI250, "GFX90A"),
        (["A100"], A100, "A100"),
        (["gfx942"], MI250, None),
        (["H100"], A100, None),
        ([], MI250, None),
        (["gfx90a"], [], None),
    ],
)
def test_skip_gpu_arch_matches_an_arch_or_a_part_of_the_gpus_name(skip, gpus, matched):
    assert skipped_gpu_arch(skip, gpus) == matched


# --- n_gpus on the node ------------------------------------------------------------------------------------------


def test_n_gpus_minus_one_gives_the_container_every_allocated_gpu(make_run):
    assert card_gpu_indices(make_run("perf.sh", gpus=MI250, n_gpus=-1), [0, 1]) == [0, 1]
    assert card_gpu_indices(make_run("perf.sh", gpus=MI250, n_gpus=-1), None) is None


def test_n_gpus_gives_the_container_the_first_n_allocated_gpus(make_run):
    assert card_gpu_indices(make_run("perf.sh", gpus=MI250, n_gpus=1), None) == [0]
    assert card_gpu_indices(make_run("perf.sh", gpus=MI250, n_gpus=1), [1]) == [1]


def test_n_gpus_above_the_nodes_allocation_is_refused_naming_the_node(make_run):
    with pytest.raises(ModelRunError, match="asks for n_gpus=4 per node, but node0 has 2 GPU"):
        card_gpu_indices(make_run("perf.sh", gpus=MI250, n_gpus=4), None)


def test_the_container_gets_only_the_first_n_gpus_in_its_docker_run(make_run, monkeypatch):
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import docker_run_args

    run = make_run("perf.sh", gpus=MI250, gpu_vendor="AMD", n_gpus=1, environ={})
    argv = docker_run_args(run, None)
    assert "/dev/dri/renderD128" in argv and "/dev/dri/renderD129" not in argv


# --- skip_gpu_arch on the node and in the record ------------------------------------------------------------------


def test_a_node_whose_gpus_match_skip_gpu_arch_starts_nothing_and_says_skipped(make_run, tmp_path, job_id):
    outcome = run_model_container(make_run("perf.sh", gpus=MI250, skip_gpu_arch=["gfx90a"]), runtime=DockerRuntime())
    assert (outcome.status["status"], outcome.started) == (job_layout.SKIPPED, False)
    assert "skip_gpu_arch 'gfx90a' matches node0's GPUs" in outcome.status["reason"]
    assert json.loads(open(outcome.status_path).read())["status"] == "SKIPPED"
    # The others stop too: a model missing a rank would wait for it.
    assert (tmp_path / "results" / job_id / "attempt-0" / "ABORT").is_file()


def test_a_node_whose_gpus_do_not_match_runs_the_model(make_run):
    outcome = run_model_container(make_run("perf.sh", gpus=MI250, skip_gpu_arch=["gfx942"]), runtime=DockerRuntime())
    assert outcome.status["status"] == job_layout.SUCCESS and outcome.started


def _skipped(node, rank):
    return clean_status(node, rank, status="SKIPPED", exit_code=None, reason="skip_gpu_arch 'gfx90a' matches")


def test_a_job_whose_every_node_skipped_is_skipped_not_a_failure():
    statuses = {node: _skipped(node, rank) for rank, node in enumerate(NODES)}
    verdict = decide_verdict(statuses, [], NODES, {"rank": 0, "reason": "skip_gpu_arch 'gfx90a' matches"})
    assert verdict.status == "SKIPPED" and "skip_gpu_arch 'gfx90a'" in verdict.reason
    assert {entry["status"] for entry in verdict.per_node.values()} == {"SKIPPED"}


def test_a_job_where_only_some_nodes_skipped_is_a_failure_naming_the_skipping_node():
    statuses = {node: clean_status(node, rank, aborted_by_rank=0) for rank, node in enumerate(NODES)}
    statuses[NODES[0]] = _skipped(NODES[0], 0)
    verdict = decide_verdict(statuses, [], NODES, {"rank": 0, "reason": "skip_gpu_arch 'gfx90a' matches"})
    assert verdict.status == "FAILURE" and f"{NODES[0]} (rank 0)" in verdict.reason


def test_a_skipped_job_has_a_skipped_perf_row(tmp_path):
    for rank, node in enumerate(NODES):
        write_node(tmp_path, "42", node, _skipped(node, rank), log="")
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record
    assert record["status"] == "SKIPPED"
    assert [row["status"] for row in record["rows"]] == ["SKIPPED"]


def test_a_card_timeout_of_minus_one_is_no_timeout(make_run):
    # MAD's -1: no timeout. Read as seconds, it would stop the run before it starts.
    outcome = run_model_container(make_run("perf.sh", timeout=-1), runtime=DockerRuntime())
    assert outcome.status["status"] == job_layout.SUCCESS and not outcome.status["timed_out"], outcome.status
