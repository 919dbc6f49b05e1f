"""What ran a job, in its record and perf rows: the container runtime and the image's identity, from the nodes'
status.json (rank 0's, the others checked against it), else the job's setting (docs/results.md)."""

import csv
import json

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import FAILURE, SUCCESS, new_status
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collect_task import (
    ARGUMENT_SPEC,
    collect_results,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collection import (
    collect_job,
    write_failure_record,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.perf_record import PERF_CSV_COLUMNS

NODES = ["node1", "node2"]
MODEL = {"name": "pyt_ddp", "n_gpus": "1"}
SQUASHFS_DIGEST = "sha256:" + "5" * 64
# What a Charliecloud build's manifest says of its base: no digest, what the fingerprint counts of it.
CHARLIECLOUD_PROVENANCE = {
    "docker_image": "ci-pyt_ddp",
    "base_docker": "lab/pytorch:base",
    "docker_sha": "tar:/srv/bases/pytorch.tar:1050000000:1700000000000000000",
    "build_duration": "3.1",
    "git_commit": "",
}


def _write_job(results_dir, job_id, runtime, image_ids, provenance):
    """Two nodes that ran cleanly under ``runtime``, each with its image ID; rank 1 prints the figure."""
    for rank, (node, image_id) in enumerate(zip(NODES, image_ids, strict=True)):
        status = new_status(
            node,
            rank,
            len(NODES),
            job_id,
            MODEL["name"],
            exit_code=0,
            started_at=1000.0,
            ended_at=1010.0,
            launcher="torchrun",
            container_runtime=runtime,
            image_id=image_id,
            provenance=provenance,
        )
        node_dir = results_dir / job_id / "attempt-0" / "nodes" / node
        node_dir.mkdir(parents=True)
        (node_dir / "status.json").write_text(json.dumps(status))
        (node_dir / "run.log").write_text("performance: 812.5 samples/sec\n" if rank == 1 else "training\n")


def _csv_rows(path):
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


def test_a_charliecloud_run_names_its_runtime_and_its_squashfs_digest_in_the_record_and_the_row(tmp_path):
    _write_job(tmp_path, "42", "charliecloud", [SQUASHFS_DIGEST] * 2, CHARLIECLOUD_PROVENANCE)
    record = collect_job(str(tmp_path), "42", model=MODEL, nodes=NODES).record
    assert record["status"] == SUCCESS
    assert (record["container_runtime"], record["image_id"], record["warnings"]) == (
        "charliecloud",
        SQUASHFS_DIGEST,
        [],
    )
    row = record["rows"][0]
    # MAD's docker_sha holds the image's own digest: the base's identity there is a path, no sha.
    assert (row["docker_sha"], row["docker_image"], row["container_runtime"]) == (
        SQUASHFS_DIGEST,
        "ci-pyt_ddp",
        "charliecloud",
    )
    # The record's CSV names the runtime after MAD's columns; perf.csv keeps MAD's 29, the digest in docker_sha.
    columns, rows = _csv_rows(tmp_path / "records" / "42.csv")
    assert columns == list(PERF_CSV_COLUMNS) + ["container_runtime"]
    assert (rows[0]["container_runtime"], rows[0]["docker_sha"]) == ("charliecloud", SQUASHFS_DIGEST)
    columns, rows = _csv_rows(tmp_path / "perf.csv")
    assert columns == list(PERF_CSV_COLUMNS)
    assert rows[0]["docker_sha"] == SQUASHFS_DIGEST


def test_a_docker_run_keeps_the_base_image_id_in_docker_sha_and_names_the_run_image_in_the_record(tmp_path):
    base_id = "sha256:" + "b" * 64
    _write_job(tmp_path, "43", "docker", ["sha256:" + "d" * 64] * 2, dict(CHARLIECLOUD_PROVENANCE, docker_sha=base_id))
    record = collect_job(str(tmp_path), "43", model=MODEL, nodes=NODES).record
    assert (record["container_runtime"], record["image_id"]) == ("docker", "sha256:" + "d" * 64)
    assert (record["rows"][0]["docker_sha"], record["rows"][0]["container_runtime"]) == (base_id, "docker")


def test_nodes_that_name_another_image_are_a_warning_and_the_record_names_rank_0s(tmp_path):
    other = "sha256:" + "6" * 64
    _write_job(tmp_path, "44", "charliecloud", [SQUASHFS_DIGEST, other], CHARLIECLOUD_PROVENANCE)
    params = {name: spec.get("default") for name, spec in ARGUMENT_SPEC.items()}
    params.update(results_dir=str(tmp_path), job_id="44", model=MODEL, nodes=NODES)
    result, warnings = collect_results(params, check_mode=False)
    # The verdict rests on the figure and the nodes' exits; the barrier is what refuses two images.
    assert result["status"] == SUCCESS
    record = json.loads((tmp_path / "records" / "44.json").read_text())
    assert record["image_id"] == SQUASHFS_DIGEST
    assert record["warnings"] == [
        f"the nodes name different image_ids: node1 (rank 0) {SQUASHFS_DIGEST}, node2 (rank 1) {other}; "
        "the record names node1's"
    ]
    assert record["warnings"][0] in warnings


def test_a_failure_record_with_no_status_files_names_the_jobs_runtime_or_none(tmp_path):
    given = write_failure_record(
        str(tmp_path), "45", "cancelled before it ran", model=MODEL, nodes=NODES, container_runtime="charliecloud"
    ).record
    assert given["status"] == FAILURE
    assert (given["container_runtime"], given["image_id"]) == ("charliecloud", "")
    assert (given["rows"][0]["container_runtime"], given["rows"][0]["docker_sha"]) == ("charliecloud", "")
    unknown = write_failure_record(str(tmp_path), "46", "cancelled before it ran", model=MODEL, nodes=NODES).record
    assert (unknown["container_runtime"], unknown["rows"][0]["container_runtime"]) == ("", "")
