"""`submit --preflight`'s node selection (slurm_multi/submission/node_selection.py): the srun, its output, the
choice."""

import json
import subprocess

import pytest

from slurm_multi.errors import SlurmMultiError
from slurm_multi.spec import JobSpec
from slurm_multi.submission import node_selection
from slurm_multi.submission.node_selection import parse_preflight_output, preflight_srun_argv, select_nodes
from slurm_multi.submission.sbatch import SlurmOptions

DOCKER_DOWN = {
    "check": "docker",
    "problem": "Docker daemon not answering on node3 (Cannot connect to the Docker daemon)",
    "fix": "start dockerd on node3",
}


def test_the_srun_keeps_the_jobs_name_partition_reservation_account_and_qos():
    slurm = SlurmOptions(nodes=2, partition="gpu", reservation="bench", account="a1", qos="high", job_name="llama")
    argv = preflight_srun_argv(slurm, ["n1", "n2", "n3"], "/venv/bin/python", "/x/preflight.py", {"checks": []})
    assert argv[:5] == ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--nodelist=n1,n2,n3"]
    for option in (
        "--job-name=llama-preflight",
        "--partition=gpu",
        "--reservation=bench",
        "--account=a1",
        "--qos=high",
    ):
        assert option in argv
    assert argv[-4:] == ["/venv/bin/python", "/x/preflight.py", "--json", '{"checks": []}']


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


@pytest.fixture
def fake_cluster(monkeypatch, tmp_path):
    """sinfo says node1-4 are usable; the srun answers as given; what srun was run with is kept."""
    seen = {}
    monkeypatch.setattr(
        node_selection.sbatch, "usable_nodes", lambda partition, reservation: [f"node{i}" for i in range(1, 5)]
    )

    def answer(lines):
        def run(argv, env, **_):
            seen.update(argv=argv, env=env)
            return subprocess.CompletedProcess(argv, 1, "\n".join(json.dumps(line) for line in lines), "")

        monkeypatch.setattr(node_selection.subprocess, "run", run)

    spec = JobSpec(tags=("dummy",), results_dir=tmp_path / "results")
    return spec, answer, seen


def _healthy(*nodes):
    return [{"node": node, "problems": []} for node in nodes]


def test_healthy_nodes_go_to_the_nodelist_and_bad_ones_to_exclude(fake_cluster, tmp_path, monkeypatch):
    spec, answer, seen = fake_cluster
    answer(_healthy("node1", "node2", "node4") + [{"node": "node3", "problems": [DOCKER_DOWN]}])
    monkeypatch.setenv("MAD_SECRETS_HFTOKEN", "never-in-the-srun-env")
    said = []
    selection = select_nodes(spec, SlurmOptions(nodes=3, exclude="node9"), tmp_path, on_progress=said.append)
    assert selection.chosen == ["node1", "node2", "node4"] and selection.left_out == {"node3": [DOCKER_DOWN]}
    assert (selection.slurm.nodelist, selection.slurm.exclude) == ("node1,node2,node4", "node9,node3")
    assert any("leaving out node3: docker: Docker daemon not answering" in line for line in said)
    assert "MAD_SECRETS_HFTOKEN" not in seen["env"] and "never-in-the-srun-env" not in " ".join(seen["argv"])


def test_too_few_healthy_nodes_is_a_clear_error(fake_cluster, tmp_path):
    spec, answer, _ = fake_cluster
    answer(_healthy("node1", "node2") + [{"node": n, "problems": [DOCKER_DOWN]} for n in ("node3", "node4")])
    with pytest.raises(SlurmMultiError) as error:
        select_nodes(spec, SlurmOptions(nodes=3), tmp_path)
    message = str(error.value)
    assert "only 2 of the 4 candidate nodes are healthy (node1, node2), the job needs 3" in message
    assert "node3: docker: Docker daemon not answering" in message and "Nothing was submitted" in message


def test_the_candidates_are_the_nodelist_without_the_excluded_ones(fake_cluster, tmp_path):
    spec, answer, seen = fake_cluster
    answer(_healthy("node2", "node4"))
    select_nodes(spec, SlurmOptions(nodes=2, nodelist="node[2-4]", exclude="node3"), tmp_path)
    assert "--nodelist=node2,node4" in seen["argv"]


def test_the_image_cache_dir_checked_is_the_one_the_nodes_resolve(fake_cluster, tmp_path, monkeypatch):
    # One rule for the controller and the nodes: MAD_DOCKER_BUILDS (the job's environment is this one's) over the
    # setting, %u the user.
    spec, answer, seen = fake_cluster
    cache = tmp_path / "builds"
    cache.mkdir(mode=0o755)
    monkeypatch.setenv("MAD_DOCKER_BUILDS", str(cache))
    answer(_healthy("node1", "node2", "node3"))
    select_nodes(spec, SlurmOptions(nodes=3), tmp_path)
    settings = json.loads(seen["argv"][seen["argv"].index("--json") + 1])
    assert {d["name"]: d["path"] for d in settings["shared_dirs"]}["image_cache_dir"] == str(cache)


def test_the_script_the_candidates_run_is_the_preflight_checks():
    from slurm_multi.paths import project_root

    assert (project_root() / node_selection.PREFLIGHT_SCRIPT).is_file()
