"""The docker CLI wrapper's failure paths, with the real docker CLI and no daemon behind the host it is given."""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, DockerStream

NO_DAEMON = "unix:///nonexistent/slurm-multi-test/docker.sock"


def test_a_streamed_docker_load_that_fails_raises_its_exit_code_and_stderr():
    with DockerStream(["load"], "in", timeout=60, host=NO_DAEMON) as stream:
        try:
            stream.pipe.write(b"not an image tar")
        except BrokenPipeError:
            pass  # the CLI may exit before reading: its exit status below says why
        with pytest.raises(DockerError, match=r"failed \(exit \d+\)") as failed:
            stream.finish()
    assert failed.value.returncode not in (None, 0)
    assert "nonexistent" in failed.value.stderr_tail  # the CLI's own reason travels with the error
