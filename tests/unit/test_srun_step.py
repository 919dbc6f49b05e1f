"""What a job step started by the srun connection sees and how srun's failures are read."""

from ansible.module_utils.srun_step import (
    is_transient_srun_error, step_command, step_environment, unreachable_reason)


def test_step_environment_keeps_the_allowlist_and_drops_secrets():
    env = {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "SLURM_JOB_ID": "5", "MAD_SECRETS_HFTOKEN": "s3cret",
           "AWS_SECRET_ACCESS_KEY": "x", "DOCKER_HOST": "unix:///elsewhere", "MAD_DOCKER_BUILDS": "/shared/c"}
    assert step_environment(env) == {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "SLURM_JOB_ID": "5",
                                     "MAD_DOCKER_BUILDS": "/shared/c"}


def test_extra_names_are_allowed_but_never_secrets():
    env = {"MY_SITE_VAR": "1", "MAD_SECRETS_X": "no"}
    assert step_environment(env, ["MY_SITE_*", "MAD_SECRETS_*"]) == {"MY_SITE_VAR": "1"}


def test_step_command_targets_one_node_of_the_job_and_overlaps():
    argv = step_command("42", "node2", "echo hi")
    assert argv[:7] == ["srun", "--jobid=42", "--overlap", "-N1", "-n1", "-w", "node2"]
    assert argv[-3:] == ["/bin/sh", "-c", "echo hi"]


def test_controller_timeouts_are_transient():
    assert is_transient_srun_error("srun: error: Socket timed out on send/recv operation")
    assert is_transient_srun_error("srun: error: Unable to contact slurm controller (connect failure)")


def test_a_task_exit_code_is_neither_transient_nor_unreachable():
    stderr = "srun: error: node2: task 0: Exited with exit code 1"
    assert not is_transient_srun_error(stderr)
    assert unreachable_reason(stderr) is None


def test_a_node_outside_the_allocation_is_unreachable_with_srun_words():
    stderr = "srun: error: Unable to create step for job 9: Requested node configuration is not available"
    assert unreachable_reason(stderr) == "Requested node configuration is not available"


def test_a_dead_node_is_unreachable():
    stderr = ("srun: error: Task launch for StepId=9.3 failed on node node3: Communication connection failure\n"
              "srun: error: Application launch failed: Communication connection failure")
    assert "Communication connection failure" in unreachable_reason(stderr)
