"""The slurm_allocation inventory plugin, the real plugin code against Ansible's real InventoryManager."""

import json

import pytest
from ansible import constants as C
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, inventory_loader

from plugins.inventory.slurm_allocation import module_python
from tests.support.ansible import BIN, ROOT, ansible_env, run_ansible


@pytest.fixture
def inventory(monkeypatch, tmp_path):
    for key in (
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURMD_NODENAME",
    ):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "site.yml").touch()
    monkeypatch.setenv("SLURM_MULTI_SITE_CONFIG", str(tmp_path / "site.yml"))
    # As ansible.cfg configures it (the test process does not read ansible.cfg).
    monkeypatch.setattr(C, "INVENTORY_ENABLED", ["slurm_allocation"])
    monkeypatch.setattr(C, "INVENTORY_UNPARSED_IS_FAILED", True)
    init_plugin_loader()
    inventory_loader.add_directory(str(ROOT / "plugins" / "inventory"))

    def load(**env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return InventoryManager(loader=DataLoader(), sources=[str(ROOT / "inventory" / "slurm.yml")])

    return load


def test_allocation_nodes_become_hosts_with_ranks_and_groups(inventory, tmp_path):
    (tmp_path / "site.yml").write_text("node_addresses:\n  node1: 127.0.0.11\n")
    inv = inventory(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node[1-3]", SLURM_JOB_NUM_NODES="3", SLURMD_NODENAME="node1")
    assert [h.name for h in inv.get_hosts()] == ["node1", "node2", "node3"]
    assert [h.name for h in inv.groups["primary"].get_hosts()] == ["node1"]
    assert [h.name for h in inv.groups["workers"].get_hosts()] == ["node2", "node3"]
    node3 = inv.get_host("node3").get_vars()
    shared = inv.groups["all"].get_vars()
    assert (node3["node_rank"], shared["nnodes"], shared["master_addr"], shared["slurm_job_id"]) == (
        2,
        3,
        "127.0.0.11",
        "77",
    )
    # Once for all nodes: a node list per host grows the inventory with the square of the node count.
    assert shared["allocation_nodes"] == ["node1", "node2", "node3"] and "allocation_nodes" not in node3
    assert node3["ansible_connection"] == "srun"
    assert inv.get_host("node1").get_vars()["ansible_connection"] == "local"


def test_outside_an_allocation_the_inventory_is_localhost(inventory):
    inv = inventory()
    assert [h.name for h in inv.get_hosts()] == ["localhost"]
    assert inv.get_host("localhost").get_vars()["ansible_connection"] == "local"


def test_malformed_hostlist_fails_naming_variable_and_value():
    result = run_ansible(
        ["ansible-inventory", "--graph"], env=ansible_env(SLURM_JOB_ID="1", SLURM_JOB_NODELIST="node[1-3")
    )
    assert result.returncode != 0
    assert "SLURM_JOB_NODELIST='node[1-3' is not a valid hostlist" in result.stderr


def test_modules_run_through_the_venvs_module_python_and_a_site_interpreter_as_given(inventory, tmp_path):
    inv = inventory(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2")
    assert inv.get_host("node2").get_vars()["ansible_python_interpreter"] == str(BIN / "slurm-multi-module-python")
    (tmp_path / "site-inventory.yml").write_text("plugin: slurm_allocation\npython_interpreter: /opt/site/python3\n")
    inv = InventoryManager(loader=DataLoader(), sources=[str(tmp_path / "site-inventory.yml")])
    assert inv.get_host("node2").get_vars()["ansible_python_interpreter"] == "/opt/site/python3"


def test_a_python_without_the_module_python_beside_it_runs_modules_itself(tmp_path):
    python = tmp_path / "python3"
    python.touch(mode=0o755)
    assert module_python(str(python)) == str(python)
    (tmp_path / "slurm-multi-module-python").touch(mode=0o755)
    assert module_python(str(python)) == str(tmp_path / "slurm-multi-module-python")


# --- the settings files: host vars of every node ----------------------------------------------------------------


def _settings_env(tmp_path, **extra):
    """ansible's environment with the site and user settings files of tmp_path (empty ones when not written: the
    variables must name files that exist)."""
    for name in ("site.yml", "settings.yml"):
        (tmp_path / name).touch()
    return ansible_env(
        SLURM_MULTI_SITE_CONFIG=str(tmp_path / "site.yml"),
        SLURM_MULTI_SETTINGS=str(tmp_path / "settings.yml"),
        **extra,
    )


def test_every_node_gets_the_site_and_user_settings_as_host_vars(tmp_path):
    (tmp_path / "site.yml").write_text("settings:\n  barrier_timeout: 900\n  heartbeat_stale: 60\n")
    (tmp_path / "settings.yml").write_text("heartbeat_stale: 45\n")
    env = _settings_env(
        tmp_path,
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_JOB_NUM_NODES="2",
        MAD_DOCKER_BUILDS="/shared/cache",
    )
    result = run_ansible(["ansible-inventory", "--list"], env=env)
    assert result.returncode == 0, result.stderr
    hostvars = json.loads(result.stdout)["_meta"]["hostvars"]
    for node in ("node1", "node2"):
        assert (hostvars[node]["barrier_timeout"], hostvars[node]["heartbeat_stale"]) == (900, 45)
        # From the environment, so marked unsafe: never templated.
        assert hostvars[node]["image_cache_dir"] == {"__ansible_unsafe": "/shared/cache"}


def test_the_settings_files_win_over_the_playbooks_group_vars_and_lose_to_e(tmp_path):
    (tmp_path / "site.yml").write_text("settings:\n  barrier_timeout: 900\n")
    (tmp_path / "settings.yml").write_text("heartbeat_stale: 45\n")
    # --playbook-dir: the playbooks' group_vars, as ansible-playbook playbooks/run_multi.yml reads them.
    show = ["ansible", "localhost", "-m", "ansible.builtin.debug", "--playbook-dir", "playbooks"]
    show += ["-a", "msg={{ [barrier_timeout, heartbeat_stale, image_cache_keep] | to_json }}"]
    plain = run_ansible(show, env=_settings_env(tmp_path))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "[900, 45, 5]" in plain.stdout  # image_cache_keep: group_vars' own
    overridden = run_ansible([*show, "-e", '{"barrier_timeout": 7}'], env=_settings_env(tmp_path))
    assert "[7, 45, 5]" in overridden.stdout


def test_an_unknown_setting_in_the_site_file_fails_the_inventory_naming_the_file(tmp_path):
    (tmp_path / "site.yml").write_text("node_addresses: {}\nsettings:\n  barrier_timout: 900\n")
    result = run_ansible(["ansible-inventory", "--list"], env=_settings_env(tmp_path))
    assert result.returncode != 0
    assert f"{tmp_path / 'site.yml'}: unknown setting 'barrier_timout' (did you mean barrier_timeout?)" in result.stderr


def test_a_site_file_its_group_may_write_fails_the_inventory_naming_the_file(tmp_path):
    # The job's own reading of the files: whoever may write the site file would set every job's node addresses.
    (tmp_path / "site.yml").write_text("node_addresses:\n  node1: 10.6.6.6\n")
    (tmp_path / "site.yml").chmod(0o664)
    env = _settings_env(tmp_path, SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1")
    result = run_ansible(["ansible-inventory", "--list"], env=env)
    assert result.returncode != 0
    assert f"{tmp_path / 'site.yml'} is writable by its group root" in result.stderr, result.stderr
    assert f"chmod go-w {tmp_path / 'site.yml'}" in result.stderr and "10.6.6.6" not in result.stdout


def test_no_node_gets_the_mode_which_whoever_starts_the_playbook_chose(tmp_path):
    # A playbook started as push (one ansible-playbook) runs as push whatever SLURM_MULTI_MODE or a file says: the
    # CLI reads them and passes its choice with -e.
    (tmp_path / "settings.yml").write_text("mode: pull\nheartbeat_stale: 45\n")
    env = _settings_env(tmp_path, SLURM_MULTI_MODE="pull", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[1-2]")
    result = run_ansible(["ansible-inventory", "--list"], env=dict(env, SLURM_JOB_NUM_NODES="2"))
    assert result.returncode == 0, result.stderr
    hostvars = json.loads(result.stdout)["_meta"]["hostvars"]
    # (ansible-inventory shows the checkout's group_vars too: the default's template, never "pull".)
    shown = [(hostvars[node].get("mode"), hostvars[node]["heartbeat_stale"]) for node in ("node1", "node2")]
    assert shown == [("{{ 'mode' | slurm_multi.pipeline.pipeline_default }}", 45)] * 2
