"""`submit --preflight`'s node selection (slurm_multi/submission/node_selection.py): the settings Ansible resolves for
the candidates, the srun, its output, the choice.

The selection tests run the real ansible-playbook (playbooks/node_selection_settings.yml, the project's ansible.cfg
and inventory) and a stand-in `srun` on PATH that records how it was called and answers as told; sinfo says node1-4
are usable.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import resolve_cache_dir
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import (
    SETTING_DEFAULTS,
    default_image_cache_dir,
)
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import project_root
from slurm_multi.spec import JobSpec
from slurm_multi.submission import node_selection
from slurm_multi.submission.node_selection import parse_preflight_output, preflight_srun_argv, select_nodes
from slurm_multi.submission.sbatch import SlurmOptions

ROOT = project_root()
DOCKER_DOWN = {
    "check": "docker",
    "problem": "Docker daemon not answering on node3 (Cannot connect to the Docker daemon)",
    "fix": "start dockerd on node3",
}
FAKE_SRUN = """#!{python}
import json, os, sys
with open({calls!r}, "a") as calls:
    calls.write(json.dumps({{"argv": sys.argv, "env": sorted(os.environ)}}) + "\\n")
with open({answer!r}) as answer:
    sys.stdout.write(answer.read())
sys.exit(1)
"""


def test_the_srun_keeps_the_jobs_name_partition_reservation_account_and_qos():
    slurm = SlurmOptions(nodes=2, partition="gpu", reservation="bench", account="a1", qos="high", job_name="llama")
    argv = preflight_srun_argv(slurm, ["n1", "n2", "n3"], "/venv/bin/python", {"checks": []})
    assert argv[:5] == ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--nodelist=n1,n2,n3"]
    for option in (
        "--job-name=llama-preflight",
        "--partition=gpu",
        "--reservation=bench",
        "--account=a1",
        "--qos=high",
    ):
        assert option in argv
    assert argv[-5:] == [
        "/venv/bin/python",
        "-m",
        "ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.preflight",
        "--json",
        '{"checks": []}',
    ]


def test_each_nodes_problems_are_read_from_its_json_line_and_a_silent_node_is_a_problem():
    stdout = "\n".join(
        [
            json.dumps({"node": "node1", "problems": [], "notes": []}),
            "srun: some warning",
            json.dumps({"node": "node3", "problems": [DOCKER_DOWN]}),
        ]
    )
    checked = parse_preflight_output(stdout, ["node1", "node2", "node3"], "srun: error: node2: task 1: Killed")
    assert checked["node1"] == [] and checked["node3"] == [DOCKER_DOWN]
    assert "no answer from the preflight check on node2 (srun: error: node2" in checked["node2"][0]["problem"]


class FakeCluster:
    """sinfo's usable nodes, and a stand-in srun that answers each node's line as told and keeps its calls."""

    def __init__(self, monkeypatch, tmp_path):
        monkeypatch.setattr(
            node_selection.sbatch, "usable_nodes", lambda partition, reservation: [f"node{i}" for i in range(1, 5)]
        )
        self.calls = tmp_path / "srun-calls.jsonl"
        self.answer = tmp_path / "srun-answer"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        srun = bin_dir / "srun"
        srun.write_text(FAKE_SRUN.format(python=sys.executable, calls=str(self.calls), answer=str(self.answer)))
        srun.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        # No site, user or environment settings but a test's own (the inventory gives them to every host).
        self.site_file = tmp_path / "site.yml"
        monkeypatch.setenv("SLURM_MULTI_SITE_CONFIG", str(self.site_file))
        (tmp_path / "no-user-settings.yml").touch()  # empty: no settings
        self.site_file.touch()
        monkeypatch.setenv("SLURM_MULTI_SETTINGS", str(tmp_path / "no-user-settings.yml"))
        monkeypatch.delenv("MAD_DOCKER_BUILDS", raising=False)
        self.spec = JobSpec(tags=("dummy",), results_dir=tmp_path / "results")
        self.answer_with()

    def answer_with(self, **problems):
        """srun's answer: each node's line, with its ``problems`` (none unless given)."""
        lines = [{"node": f"node{i}", "problems": problems.get(f"node{i}", [])} for i in range(1, 5)]
        self.answer.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    def sruns(self):
        """Each srun call: ``{"argv", "env", "nodes", "settings"}``."""
        calls = [json.loads(line) for line in self.calls.read_text().splitlines()] if self.calls.exists() else []
        for call in calls:
            argv = call["argv"]
            call["nodes"] = next(a for a in argv if a.startswith("--nodelist=")).split("=", 1)[1].split(",")
            call["settings"] = json.loads(argv[argv.index("--json") + 1])
        return calls

    def settings_of(self, node):
        """The settings ``node`` was checked with."""
        return next(call["settings"] for call in self.sruns() if node in call["nodes"])


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    return FakeCluster(monkeypatch, tmp_path)


def test_healthy_nodes_go_to_the_nodelist_and_bad_ones_to_exclude(cluster, monkeypatch):
    cluster.answer_with(node3=[DOCKER_DOWN])
    monkeypatch.setenv("MAD_SECRETS_HFTOKEN", "never-in-the-srun-env")
    said = []
    selection = select_nodes(cluster.spec, SlurmOptions(nodes=3, exclude="node9"), ROOT, on_progress=said.append)
    assert selection.chosen == ["node1", "node2", "node4"] and selection.left_out == {"node3": [DOCKER_DOWN]}
    assert (selection.slurm.nodelist, selection.slurm.exclude) == ("node1,node2,node4", "node9,node3")
    assert any("leaving out node3: docker: Docker daemon not answering" in line for line in said)
    (srun,) = cluster.sruns()
    assert "MAD_SECRETS_HFTOKEN" not in srun["env"] and "never-in-the-srun-env" not in " ".join(srun["argv"])


def test_too_few_healthy_nodes_is_a_clear_error(cluster):
    cluster.answer_with(node3=[DOCKER_DOWN], node4=[DOCKER_DOWN])
    with pytest.raises(SlurmMultiError) as error:
        select_nodes(cluster.spec, SlurmOptions(nodes=3), ROOT)
    message = str(error.value)
    assert "only 2 of the 4 candidate nodes are healthy (node1, node2), the job needs 3" in message
    assert "node3: docker: Docker daemon not answering" in message and "Nothing was submitted" in message


def test_the_candidates_are_the_nodelist_without_the_excluded_ones(cluster):
    select_nodes(cluster.spec, SlurmOptions(nodes=2, nodelist="node[2-4]", exclude="node3"), ROOT)
    assert [srun["nodes"] for srun in cluster.sruns()] == [["node2", "node4"]]


def test_a_setting_given_by_the_jobs_extra_vars_is_the_one_the_candidates_are_checked_with(cluster):
    # `submit -e preflight_max_clock_skew=3`: the job's extra vars, as the job's own preflight stage gets them.
    spec = JobSpec(tags=("dummy",), results_dir=cluster.spec.results_dir, extra_vars={"preflight_max_clock_skew": 3})
    select_nodes(spec, SlurmOptions(nodes=4), ROOT)
    assert [srun["settings"]["max_clock_skew"] for srun in cluster.sruns()] == [3]


def _inventory_dir(tmp_path, group_vars):
    """An inventory of the user's: the allocation's nodes (as inventory/slurm.yml lists them), its groups' vars."""
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "slurm.yml").write_text((ROOT / "inventory" / "slurm.yml").read_text())
    for group, text in group_vars.items():
        (inventory / "group_vars" / f"{group}.yml").write_text(text)
    return inventory


def test_a_setting_of_an_inventory_group_is_the_one_its_nodes_are_checked_with(cluster, tmp_path, monkeypatch):
    # The workers (every candidate after the first, as in the job's allocation) get their group's value, the
    # first candidate the playbook's default; the job's play reads the same inventory (ANSIBLE_INVENTORY).
    inventory = _inventory_dir(tmp_path, {"workers": "preflight_max_clock_skew: 2.5\n"})
    monkeypatch.setenv("ANSIBLE_INVENTORY", str(inventory))
    selection = select_nodes(cluster.spec, SlurmOptions(nodes=4), ROOT)
    assert selection.chosen == ["node1", "node2", "node3", "node4"]
    assert cluster.settings_of("node1")["max_clock_skew"] == SETTING_DEFAULTS["preflight_max_clock_skew"]
    assert [cluster.settings_of(node)["max_clock_skew"] for node in ("node2", "node3", "node4")] == [2.5, 2.5, 2.5]
    assert sorted(srun["nodes"] for srun in cluster.sruns()) == [["node1"], ["node2", "node3", "node4"]]


def test_a_setting_of_the_site_file_is_the_one_the_candidates_are_checked_with(cluster):
    cluster.site_file.write_text("settings:\n  preflight_max_clock_skew: 4\n")
    select_nodes(cluster.spec, SlurmOptions(nodes=4), ROOT)
    assert [srun["settings"]["max_clock_skew"] for srun in cluster.sruns()] == [4]


def test_a_setting_ansible_cannot_resolve_stops_the_selection_before_any_check(cluster, tmp_path, monkeypatch):
    broken = {"workers": "preflight_max_clock_skew: '{{ no_such_variable }}'\n"}
    monkeypatch.setenv("ANSIBLE_INVENTORY", str(_inventory_dir(tmp_path, broken)))
    with pytest.raises(SlurmMultiError) as error:
        select_nodes(cluster.spec, SlurmOptions(nodes=2), ROOT)
    assert "Ansible could not resolve the job's settings" in str(error.value)
    assert "no_such_variable" in str(error.value) and "Nothing was submitted" in str(error.value)
    assert cluster.sruns() == []


def test_a_candidate_the_inventory_does_not_list_is_left_out_naming_why(cluster, tmp_path, monkeypatch):
    # A site's static inventory in place of the allocation's (ansible.cfg enables only slurm_allocation's).
    hosts = tmp_path / "hosts.ini"
    hosts.write_text("[primary]\nnode1\n[workers]\nnode2\nnode3\n")
    monkeypatch.setenv("ANSIBLE_INVENTORY", str(hosts))
    monkeypatch.setenv("ANSIBLE_INVENTORY_ENABLED", "ini")
    selection = select_nodes(cluster.spec, SlurmOptions(nodes=3), ROOT)
    assert selection.chosen == ["node1", "node2", "node3"]
    assert "Ansible's inventory lists no host node4" in selection.left_out["node4"][0]["problem"]
    assert [srun["nodes"] for srun in cluster.sruns()] == [["node1", "node2", "node3"]]


def test_an_inventory_without_hosts_leaves_out_every_candidate(cluster, tmp_path, monkeypatch):
    (tmp_path / "hosts.ini").write_text("")
    monkeypatch.setenv("ANSIBLE_INVENTORY", str(tmp_path / "hosts.ini"))
    monkeypatch.setenv("ANSIBLE_INVENTORY_ENABLED", "ini")
    with pytest.raises(SlurmMultiError, match="only 0 of the 4 candidate nodes are healthy") as error:
        select_nodes(cluster.spec, SlurmOptions(nodes=2), ROOT)
    assert "node1: preflight: Ansible's inventory lists no host node1" in str(error.value)
    assert cluster.sruns() == []


def test_the_image_cache_dir_checked_is_the_jobs_one_inside_its_results_dir(cluster):
    # group_vars' default follows the job's results_dir: Ansible resolves it, as the job's preflight stage does.
    cache = Path(resolve_cache_dir(default_image_cache_dir(str(cluster.spec.results_dir))))
    cache.mkdir(parents=True, mode=0o755)
    select_nodes(cluster.spec, SlurmOptions(nodes=4), ROOT)
    shared = {entry["name"]: entry["path"] for entry in cluster.settings_of("node1")["shared_dirs"]}
    assert shared == {"results_dir": str(cluster.spec.results_dir), "image_cache_dir": str(cache)}


def test_a_registry_mode_job_has_no_image_cache_dir_to_check(cluster):
    Path(resolve_cache_dir(default_image_cache_dir(str(cluster.spec.results_dir)))).mkdir(parents=True, mode=0o755)
    spec = JobSpec(tags=("dummy",), results_dir=cluster.spec.results_dir, registry="127.0.0.1:17500/bench")
    select_nodes(spec, SlurmOptions(nodes=4), ROOT)
    assert [entry["name"] for entry in cluster.settings_of("node1")["shared_dirs"]] == ["results_dir"]


def test_the_image_cache_dir_checked_is_the_one_the_nodes_resolve(cluster, tmp_path, monkeypatch):
    # One rule for the controller and the nodes: MAD_DOCKER_BUILDS (the job's environment is this one's) over the
    # setting, %u the user.
    cache = tmp_path / "builds"
    cache.mkdir(mode=0o755)
    monkeypatch.setenv("MAD_DOCKER_BUILDS", str(cache))
    select_nodes(cluster.spec, SlurmOptions(nodes=3), ROOT)
    shared = {entry["name"]: entry["path"] for entry in cluster.settings_of("node1")["shared_dirs"]}
    assert shared["image_cache_dir"] == str(cache)


def test_the_candidates_run_the_preflight_module_of_the_contents_collection():
    from slurm_multi.paths import project_root

    argv = preflight_srun_argv(SlurmOptions(nodes=1), ["node1"], "/venv/bin/python", {"checks": []})
    module = argv[argv.index("-m") + 1]
    assert (project_root() / "collections" / module.replace(".", "/")).with_suffix(".py").is_file()
