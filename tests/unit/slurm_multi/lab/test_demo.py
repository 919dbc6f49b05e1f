"""`make demo`'s job: the runtime it asks for (RUNTIME=), and a clear refusal of one it does not know."""

import pytest

from slurm_multi.errors import UserError
from slurm_multi.lab.demo import demo_submit_args


def test_the_demo_under_charliecloud_asks_for_that_runtime():
    args = demo_submit_args("dummy_lastrank", "charliecloud")
    assert args[args.index("-e") + 1] == "container_runtime=charliecloud"


def test_the_demo_under_docker_leaves_the_default_runtime():
    assert "-e" not in demo_submit_args("dummy_lastrank", "docker")


def test_an_unknown_runtime_is_refused_naming_the_runtimes_the_demo_knows():
    with pytest.raises(UserError, match="RUNTIME=podman .* docker, charliecloud"):
        demo_submit_args("dummy_lastrank", "podman")
