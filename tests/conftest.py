"""Shared pytest set-up. pyproject's `pythonpath` puts the checkout and collections/ on sys.path: the project's
module_utils import as ``ansible_collections.slurm_multi.pipeline.plugins.module_utils.<name>``, as everywhere else."""

import os
from pathlib import Path

import pytest
from ansible.plugins.loader import init_plugin_loader

from tests.support.dockerd import build_busybox_image, running_private_dockerd

ROOT = Path(__file__).resolve().parent.parent
# Ansible's collection finder serves every import of the collection in the tests, as it does in ansible-playbook's
# process: a test that loads plugins in-process (init_plugin_loader) would otherwise install it halfway through a
# worker, after the collection was imported without it, and every module_utils module imported next would fail.
init_plugin_loader()


@pytest.fixture(scope="session")
def private_dockerd():
    """A real Docker daemon of this test session's own (root only)."""
    with running_private_dockerd("slurm-multi-testd-") as daemon:
        yield daemon


@pytest.fixture(scope="session")
def busybox_image(private_dockerd):
    """(tag, image_id) of a 2 MB busybox image in the private daemon."""
    tag = "slurm-multi-test/busybox:latest"
    return tag, build_busybox_image(private_dockerd, tag)


@pytest.fixture(scope="session")
def lab_cluster():
    """The lab cluster (3 nodes), brought up when needed; left running for other checkouts and the next session."""
    if os.geteuid() != 0:
        pytest.skip("the lab cluster needs root")
    from slurm_multi.lab import cluster as lab

    lab.up(3, progress=lambda msg: None)
    return lab.lab_nodes(3)


@pytest.fixture(scope="session", autouse=True)
def base_temp_dir_made_before_any_thread(tmp_path_factory):
    """pytest makes a worker's base temp dir on the first mktemp, unguarded: when that first call came from two
    threads of tests.support.lab.per_mode_jobs.side_by_side at once, one of them failed (FileExistsError on
    .../popen-gw1, test_requeue[push] in CI). Made here, once per worker, before any test starts a thread."""
    return tmp_path_factory.getbasetemp()


@pytest.fixture(autouse=True)
def pipeline_mode(request, monkeypatch):
    """The mode a lab test runs the pipeline in (push or pull, through SLURM_MULTI_MODE); None elsewhere.

    Set for the test only: a module-scoped fixture is set up before it, so one that runs a job for several tests
    returns tests.support.lab.per_mode_jobs.once_per_mode(...), which each test calls with its pipeline_mode."""
    mode = getattr(request, "param", None)
    if mode:
        monkeypatch.setenv("SLURM_MULTI_MODE", mode)
    return mode


# The fixtures that start a Docker daemon of the test session's own, and the one that brings the lab up. A test using
# one is marked for it at collection, so `-m "not lab and not docker"` is a true unit run that needs neither.
DOCKER_FIXTURES = frozenset({"private_dockerd", "busybox_image", "worker_dockerd"})
LAB_FIXTURES = frozenset({"lab_cluster"})
INTEGRATION = ROOT / "tests" / "integration"


# The shared lab run's modules, longest first (seconds on one worker, measured at 0b40096), the ones that mostly wait
# (SLURM's requeue hold, a time limit) among the ones that compute: run_suite.sh turns off xdist's own order (by test
# count), which left the few-test modules that wait last, one worker idle beside them.
LONGEST_FIRST = (
    "test_sweep_lab",  # 249
    "test_requeue",  # 205, waits (87 s alone since its two jobs run at once again)
    "test_real_workloads_lab",  # 240
    "test_pipeline_lab",  # 160
    "test_prebuilt_image_lab",  # 153
    "test_registry_credentials_lab",  # 144
    "test_timeline_lab",  # 140
    "test_submit_pipeline_lab",  # 116, waits
    "test_registry_mode_lab",  # 121
    "test_bad_input",  # 110
    "test_image_cache_dir",  # 89
    "test_model_crash",  # 76
    "test_concurrent_jobs",  # 73
    "test_html_report_lab",  # about 60 (one series of four jobs since f849416)
)


def pytest_collection_modifyitems(items):
    # A stable sort: each module's tests keep their order, the modules not named keep theirs, after the named ones.
    rank = {module: index for index, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(LONGEST_FIRST)))
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & DOCKER_FIXTURES:
            item.add_marker(pytest.mark.docker)
        if used & LAB_FIXTURES and not item.get_closest_marker("lab"):
            item.add_marker(pytest.mark.lab)
        # Only the integration tests (and a fault marked lab_shared) may share the lab with another test's jobs
        # (make test runs them two at a time): the faults break nodes and assert time bounds, the others are few.
        if item.get_closest_marker("lab") and not item.get_closest_marker("lab_shared"):
            if item.get_closest_marker("fault") or INTEGRATION not in Path(item.path).parents:
                item.add_marker(pytest.mark.lab_serial)


def pytest_generate_tests(metafunc):
    # Every lab and fault test runs in both modes: what one mode does, the other must do as well. A lab test that
    # starts no pipeline (mode_independent) would only repeat itself.
    definition = metafunc.definition
    if (
        "pipeline_mode" in metafunc.fixturenames
        and definition.get_closest_marker("lab")
        and not definition.get_closest_marker("mode_independent")
    ):
        metafunc.parametrize("pipeline_mode", ["push", "pull"], indirect=True)
