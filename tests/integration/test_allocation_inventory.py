"""The allocation as inventory, on the lab cluster: srun reaches every node, secrets stay home, guards hold."""

import json
import subprocess
import uuid

import pytest

from tests.support.ansible import BIN, ROOT, ansible_env, run_ansible

pytestmark = [pytest.mark.lab, pytest.mark.mode_independent]


def test_inventory_inside_an_allocation_shows_the_nodes_and_groups(lab_cluster):
    result = run_ansible(["ansible-inventory", "--list"], nodes=3)
    assert result.returncode == 0, result.stderr
    inventory = json.loads(result.stdout)
    assert inventory["primary"]["hosts"] == ["node1"]
    assert inventory["workers"]["hosts"] == ["node2", "node3"]
    hostvars = inventory["_meta"]["hostvars"]
    assert [hostvars[n]["node_rank"] for n in ("node1", "node2", "node3")] == [0, 1, 2]
    # Inventory strings come back marked unsafe (never templated): {"__ansible_unsafe": value}.
    assert {hostvars[n]["master_addr"]["__ansible_unsafe"] for n in hostvars} == {"127.0.0.11"}


def test_ping_and_hostname_reach_three_distinct_nodes_through_srun(lab_cluster):
    result = run_ansible(
        ["ansible", "all", "-m", "ansible.builtin.command", "-a", "hostname", "-f", "3", "-o"], nodes=3
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "CHANGED" in line)
    assert [line.split()[0] for line in lines] == ["node1", "node2", "node3"]
    assert [line.split()[-1] for line in lines] == ["node1", "node2", "node3"]
    ping = run_ansible(["ansible", "all", "-m", "ansible.builtin.ping", "-f", "3", "-o"], nodes=3)
    assert ping.stdout.count("SUCCESS") == 3, ping.stdout + ping.stderr


def test_inside_an_sbatch_job_the_batch_host_is_local_and_others_use_srun(lab_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(
        f"#!/bin/sh\ncd {ROOT}\n{BIN}/ansible all -m ansible.builtin.command -a hostname -f 3 -o\n"
        f"{BIN}/ansible-inventory --host node1\n"
    )
    out = tmp_path / "job.out"
    subprocess.run(
        ["sbatch", "-N", "3", "--wait", "-o", str(out), str(script)],
        check=True,
        env=ansible_env(),
        capture_output=True,
        timeout=120,
    )
    text = out.read_text()
    for node in ("node1", "node2", "node3"):
        assert f"{node} | CHANGED | rc=0 | (stdout) {node}" in text, text
    assert '"ansible_connection": "local"' in text


def test_secrets_in_the_controller_environment_do_not_reach_a_step(lab_cluster):
    secret = f"secret-{uuid.uuid4().hex}"
    result = run_ansible(
        ["ansible-playbook", "tests/integration/playbooks/step_environment.yml", "-f", "3"],
        nodes=3,
        env=ansible_env(MAD_SECRETS_TEST=secret),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node2 " in result.stdout and "PATH=" in result.stdout
    assert secret not in result.stdout + result.stderr


def test_guards_refuse_fewer_forks_than_nodes(lab_cluster):
    result = run_ansible(["ansible-playbook", "tests/integration/playbooks/guarded_hostname.yml", "-f", "2"], nodes=3)
    assert result.returncode != 0
    assert "ansible_forks is 2 but the allocation has 3 nodes" in result.stdout
    assert "Run with -f 3" in result.stdout


def test_guards_refuse_a_limit_that_leaves_nodes_out(lab_cluster):
    result = run_ansible(
        ["ansible-playbook", "tests/integration/playbooks/guarded_hostname.yml", "-f", "3", "--limit", "node2"], nodes=3
    )
    assert result.returncode != 0
    assert "must run on every node of the allocation (node1, node2, node3)" in result.stdout
    assert "Drop --limit" in result.stdout


def test_a_node_outside_the_allocation_is_reported_unreachable_by_name(lab_cluster):
    result = run_ansible(
        [
            "ansible",
            "node3",
            "-m",
            "ansible.builtin.ping",
            "-o",
            "-i",
            "node3,",
            "-c",
            "srun",
            "-e",
            f"ansible_python_interpreter={BIN}/python",
        ],
        nodes=2,
    )
    assert result.returncode != 0
    assert "node node3 is unreachable through srun" in result.stdout + result.stderr


def test_the_ansible_content_runs_in_a_venv_without_the_package(lab_cluster, tmp_path):
    # The plugins reach module_utils through the content's own collection (collections/), never slurm_multi: a
    # venv holding ansible-core and the node-side requirements, without the package, parses the pipeline and the
    # allocation's inventory. Its site-packages is this venv's, minus the package (an editable install's finder is
    # a .pth file of this venv, which a plain path entry does not run).
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([str(BIN / "python"), "-m", "venv", "--without-pip", str(venv)], check=True)
    (next(venv.glob("lib/python*/site-packages")) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = str(venv / "bin" / "python")
    env = dict(ansible_env(), PYTHONPATH="")
    absent = subprocess.run([python, "-c", "import slurm_multi"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "No module named 'slurm_multi'" in absent.stderr
    syntax = subprocess.run(
        [python, "-m", "ansible.cli.playbook", str(ROOT / "playbooks" / "run_multi.yml"), "--syntax-check"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    listed = subprocess.run(
        ["salloc", "-N", "3", "--quiet", python, "-m", "ansible.cli.inventory"]
        + ["-i", str(ROOT / "inventory" / "slurm.yml"), "--list"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert json.loads(listed.stdout)["workers"]["hosts"] == ["node2", "node3"]
