"""`slurm-multi job-end` (job_end.record_job_end, what the afterany collect job runs) refuses what it must not
record: a job ID that is none, and a job SLURM still runs (the real lab's SLURM)."""

import json
import subprocess

import pytest

from slurm_multi.errors import SlurmMultiError
from slurm_multi.submission import job_end


def _vars_file(tmp_path):
    path = tmp_path / "job.vars.json"
    path.write_text(json.dumps({"results_dir": str(tmp_path / "results")}))
    return path


def test_a_job_id_that_is_none_is_refused_naming_it(tmp_path):
    with pytest.raises(SlurmMultiError, match=r"job_id '\.\./x' is not a SLURM job ID"):
        job_end.record_job_end("../x", _vars_file(tmp_path))
    assert not (tmp_path / "results").exists()


def test_the_record_of_a_job_that_left_no_status_names_the_runtime_the_job_was_given():
    # -e wins over the site's and the user's settings files, as in the job itself.
    assert job_end._container_runtime({"results_dir": "/r", "container_runtime": "charliecloud"}) == "charliecloud"


def test_a_job_still_running_is_refused_and_nothing_is_recorded(lab_cluster, tmp_path):
    job_id = subprocess.run(
        ["sbatch", "--parsable", "-N1", "--no-requeue", "-o", "/dev/null", "--wrap", "sleep 120"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        with pytest.raises(SlurmMultiError, match=rf"job {job_id} is still (PENDING|RUNNING|CONFIGURING)"):
            job_end.record_job_end(job_id, _vars_file(tmp_path))
    finally:
        subprocess.run(["scancel", job_id], check=False)
    assert not (tmp_path / "results" / "records").exists()
