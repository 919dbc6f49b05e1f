"""Fixtures for a node's model run against the session's private Docker daemon.

A test module gets them with ``pytest_plugins = ("tests.support.lab.model_run_fixtures",)`` (a plugin module, so pytest
loads it once and the fixture names are not imported names that the module's tests would shadow).
"""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import ModelRun
from tests.support.dockerd import job_leaving_no_containers
from tests.support.lab.model_runs import MODELS


@pytest.fixture
def docker_host(private_dockerd, monkeypatch):
    """Point every docker CLI call of the code under test at the private daemon."""
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    return private_dockerd


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    for name, text in MODELS.items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture
def job_id(docker_host):
    """A fresh job ID; afterwards no container of that job may be left on the daemon."""
    with job_leaving_no_containers(docker_host, "t") as job:
        yield job


@pytest.fixture
def make_run(busybox_image, model_dir, tmp_path, job_id):
    def make(script, rank=0, nnodes=1, **overrides):
        options = dict(
            job_id=job_id,
            rank=rank,
            nnodes=nnodes,
            node=f"node{rank}",
            model="dummy",
            image=busybox_image[0],
            model_dir=str(model_dir),
            script=script,
            results_dir=str(tmp_path / "results"),
            master_addr="127.0.0.1",
            master_port=29500,
            user="tester",
            poll_interval=0.2,
            stop_grace=1,
            diagnostics_budget=10,
        )
        options.update(overrides)
        return ModelRun(**options)

    return make
