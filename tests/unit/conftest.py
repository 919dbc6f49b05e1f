"""Fixtures the unit tests of more than one file share."""

import pytest

from tests.support.dockerd import running_private_dockerd


@pytest.fixture(scope="module")
def worker_dockerd():
    """A second daemon, standing for a worker node that lacks rank 0's image (image cache tests)."""
    with running_private_dockerd("slurm-multi-worker-") as daemon:
        yield daemon
