"""The job's own check of every setting (plugins/filter/job_layout.py's setting_problems, the first task of
run_multi.yml): the one `slurm-multi submit` makes, for what reaches the job past it (a raw ansible-playbook -e, an
inventory of the user's own)."""

from tests.support.ansible import ansible_env, run_ansible


def test_a_raw_playbook_run_with_a_bad_setting_stops_at_its_first_task_naming_it(tmp_path):
    (tmp_path / "site.yml").touch()  # an empty site file: none of the lab's settings
    env = ansible_env(HOME=str(tmp_path), SLURM_MULTI_SITE_CONFIG=str(tmp_path / "site.yml"))
    argv = ["ansible-playbook", "playbooks/run_multi.yml", "-e", "hang_timeout=five", "-e", f"results_dir={tmp_path}/r"]
    ran = run_ansible(argv, env=env)
    output = ran.stdout + ran.stderr
    assert ran.returncode != 0, output
    assert "hang_timeout 'five' is not a number: hang_timeout takes a number (0 or more)" in output, output
    # Nothing ran on the node: no stage task, no results written.
    assert "TASK [preflight" not in output and "TASK [Guard the play]" not in output, output
    assert not (tmp_path / "r").exists()
