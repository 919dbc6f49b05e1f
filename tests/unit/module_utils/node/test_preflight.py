"""Preflight checks (module_utils/node/preflight.py): each check's verdict on recorded tool outputs and real dirs."""

import json
import os
import subprocess
import sys
from pathlib import Path

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.nvidia_tools import (
    nvidia_gpus_from_rows,
    parse_nvidia_smi_csv,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.node import preflight
from tests.support.ansible import BIN, ansible_env

ROOT = Path(__file__).resolve().parents[4]
# As node selection's srun runs it on a node: a bare Python (-S, no site-packages), the content's collections/
# on PYTHONPATH.
PREFLIGHT = [sys.executable, "-S", "-m", "ansible_collections.slurm_multi.pipeline.plugins.module_utils.node.preflight"]
BARE = {"PYTHONPATH": str(ROOT / "collections")}
FIXTURES = ROOT / "tests" / "fixtures" / "gpu-tools"


def recorded(name):
    return (FIXTURES / name).read_text()


def test_disk_names_the_figures():
    found = preflight.disk_problem("node2", "/var/lib/docker", int(2e9), int(9e9), 5)
    assert found["check"] == "disk" and "2.0 GB free" in found["problem"] and "9.0 GB" in found["problem"]
    assert "node2" in found["problem"] and "14.0 GB in all" in found["problem"]
    assert preflight.disk_problem("node2", "/d", int(20e9), int(9e9), 5) is None
    assert preflight.disk_problem("node2", "/d", int(6e9), None, 5) is None


def test_gpus_recorded_nvidia_node_against_the_grant_and_the_card():
    gpus = nvidia_gpus_from_rows(parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-csv-1.txt")))
    assert len(gpus) == 1
    assert preflight.gpu_problems("node1", "NVIDIA", len(gpus), [0], 1) == []
    granted = preflight.gpu_problems("node1", "NVIDIA", len(gpus), [0, 1, 2, 3], None, variable="SLURM_JOB_GPUS")
    assert len(granted) == 1 and "SLURM granted GPUs 0,1,2,3 (SLURM_JOB_GPUS)" in granted[0]["problem"]
    assert "1 NVIDIA GPU(s)" in granted[0]["problem"]
    card = preflight.gpu_problems("node1", "NVIDIA", len(gpus), None, 8)
    assert [p["check"] for p in card] == ["gpus"] and "n_gpus=8" in card[0]["problem"]
    vendor = preflight.gpu_problems("node1", "NVIDIA", len(gpus), None, None, "AMD")
    assert "asks for AMD" in vendor[0]["problem"]


def test_gpus_a_node_without_gpus_passes_when_none_is_granted_or_asked():
    assert preflight.gpu_problems("node1", "none", 0, None, None) == []
    assert preflight.gpu_problems("node1", "none", 0, None, 0) == []
    assert preflight.gpu_problems("node1", "none", 0, None, -1) == []
    assert preflight.gpu_problems("node1", "none", 0, None, 2)[0]["problem"].startswith("the model card asks n_gpus=2")


def test_gpu_holders_from_docker_inspect():
    inspected = [
        {"Name": "/amd", "State": {"Running": True}, "HostConfig": {"Devices": [{"PathOnHost": "/dev/kfd"}]}},
        {
            "Name": "/nv",
            "State": {"Running": True},
            "HostConfig": {"DeviceRequests": [{"Capabilities": [["gpu"]], "Count": -1}]},
        },
        {"Name": "/cpu", "State": {"Running": True}, "HostConfig": {"Devices": [{"PathOnHost": "/dev/null"}]}},
        {"Name": "/ended", "State": {"Running": False}, "HostConfig": {"Devices": [{"PathOnHost": "/dev/kfd"}]}},
    ]
    holders = preflight.gpu_holders(inspected)
    assert holders == {"amd": ["/dev/kfd"], "nv": ["gpus (device request)"]}
    problems = preflight.stale_gpu_problems("node1", holders, {"amd": "its SLURM job 7 is RUNNING"})
    assert [p["check"] for p in problems] == ["stale_gpu_containers"] * 2
    assert "container amd" in problems[0]["problem"] and "job 7" in problems[0]["problem"]


def test_clock_skew_beyond_the_bound():
    assert preflight.clock_problem("node3", 1000.0, 1003.0, 5, "the controller's") is None
    found = preflight.clock_problem("node3", 1000.0, 1012.5, 5, "the controller's")
    assert "12.5 s behind the controller's" in found["problem"] and "bound 5 s" in found["problem"]


def test_scratch(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert preflight.scratch_problem("node1", str(private)) is None
    assert "does not exist" in preflight.scratch_problem("node1", str(tmp_path / "absent"))["problem"]
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    assert "without the sticky bit" in preflight.scratch_problem("node1", str(open_dir))["problem"]
    open_dir.chmod(0o1777)
    assert preflight.scratch_problem("node1", str(open_dir)) is None


def test_shared_dir_nonce(tmp_path):
    nonce_file = tmp_path / "attempt" / preflight.NONCE_FILE
    dirs = [{"name": "results_dir", "path": str(tmp_path), "nonce_file": str(nonce_file)}]
    missing = preflight.shared_dir_problems("node2", dirs, "abc")
    assert "results_dir" in missing[0]["problem"] and str(nonce_file) in missing[0]["problem"]
    assert "node2" in missing[0]["problem"]
    preflight.write_nonce(str(nonce_file), "abc")
    assert preflight.shared_dir_problems("node2", dirs, "abc") == []
    assert "holds another nonce" in preflight.shared_dir_problems("node2", dirs, "xyz")[0]["problem"]


def test_record_section_every_node_and_the_missing_one(tmp_path):
    attempt = str(tmp_path)
    preflight.write_result(attempt, {"node": "node1", "problems": []})
    bad = [preflight.problem("docker", "Docker daemon not answering on node3", "start dockerd")]
    statuses = {"node1": None, "node2": None, "node3": {"preflight": bad}}
    section = preflight.record_section(attempt, ["node1", "node2", "node3"], statuses)
    assert section["node1"] == [] and section["node3"] == bad
    assert "node2 left no preflight result" in section["node2"][0]["problem"]
    assert preflight.record_section(str(tmp_path / "none"), ["node1"], {"node1": None}) is None
    # The stage off, a later stage failed: the rescues' empty lists do not make a preflight section.
    later = {"node1": {"preflight": []}, "node2": {"status": "FAILURE"}}
    assert preflight.record_section(str(tmp_path / "none"), ["node1", "node2"], later) is None


def test_pull_exchange_reports_the_other_nodes(tmp_path):
    attempt = str(tmp_path)
    preflight.write_result(attempt, {"node": "node1", "problems": [preflight.problem("disk", "full", "free")]})
    others = preflight.wait_for_results(attempt, ["node1", "node2"], 0.3)
    assert others["node1"][0]["problem"] == "full" and "node2 left no preflight result" in others["node2"][0]["problem"]


def test_every_check_runs_and_docker_down_is_named(tmp_path):
    env = dict(
        os.environ, DOCKER_HOST=f"unix://{tmp_path}/no.sock", SLURMD_NODENAME="node9", TMPDIR=str(tmp_path), **BARE
    )
    settings = {"checks": ["docker", "disk", "clock", "scratch"], "reference_time": 0, "max_clock_skew": 5}
    out = subprocess.run([*PREFLIGHT, "--json", json.dumps(settings)], env=env, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    result = json.loads(out.stdout)
    assert result["node"] == "node9"
    checks = [p["check"] for p in result["problems"]]
    assert checks == ["clock", "docker"], result
    assert "Docker daemon not answering on node9" in result["problems"][1]["problem"]
    assert "disk: not checked, Docker does not answer" in result["notes"]


def test_a_check_turned_off_reports_nothing(tmp_path):
    env = dict(os.environ, DOCKER_HOST=f"unix://{tmp_path}/no.sock", SLURMD_NODENAME="node9", **BARE)
    settings = {"checks": ["disk"]}
    out = subprocess.run(
        [*PREFLIGHT, "--json", json.dumps(settings)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["notes"] == ["disk: not checked, Docker does not answer"]


def test_unknown_check_is_refused():
    out = subprocess.run(
        [*PREFLIGHT, "--json", '{"checks": ["dsk"]}'],
        env=dict(os.environ, **BARE),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "unknown preflight checks ['dsk']" in out.stderr


def test_the_controller_writes_the_nonce_into_the_shared_dirs(tmp_path, monkeypatch):
    import pytest
    from ansible.errors import AnsibleFilterError

    from plugins.filter.preflight import preflight_shared_dirs

    monkeypatch.delenv("MAD_DOCKER_BUILDS", raising=False)
    results, cache = tmp_path / "results", tmp_path / "cache"
    results.mkdir(mode=0o755)
    # A cache dir not made yet is the build stage's to create: not checked.
    assert [d["name"] for d in preflight_shared_dirs(str(results), "42", 0, str(cache))] == ["results_dir"]
    cache.mkdir(mode=0o700)
    dirs = preflight_shared_dirs(str(results), "42", 0, str(cache))
    assert [d["nonce_file"] for d in dirs] == [
        str(results / "42" / "attempt-0" / "preflight.nonce"),
        str(cache / ".preflight" / "42-0.nonce"),
    ]
    assert preflight.write_shared_nonces("n0nce", dirs, str(results)) == [d["nonce_file"] for d in dirs]
    assert preflight.shared_dir_problems("node1", dirs, "n0nce") == []
    cache.chmod(0o777)
    with pytest.raises(AnsibleFilterError, match="writable by other users"):
        preflight_shared_dirs(str(results), "42", 0, str(cache))


def test_the_nonce_module_writes_nothing_in_check_mode_and_every_file_otherwise(tmp_path):
    import json

    from tests.support.ansible import run_ansible

    results = tmp_path / "results"
    results.mkdir(mode=0o755)
    nonce_file = results / "42" / "attempt-0" / "preflight.nonce"
    args = {"nonce": "n0nce", "results_dir": str(results)}
    args["shared_dirs"] = [{"name": "results_dir", "path": str(results), "nonce_file": str(nonce_file)}]
    argv = ["ansible", "localhost", "-c", "local", "-m", "preflight_nonce", "-a", json.dumps(args)]
    checked = run_ansible([*argv, "--check"])
    assert checked.returncode == 0 and str(nonce_file) in checked.stdout, checked.stdout + checked.stderr
    assert not nonce_file.exists() and not nonce_file.parent.exists()
    written = run_ansible(argv)
    assert written.returncode == 0, written.stdout + written.stderr
    assert nonce_file.read_text() == "n0nce"


def test_the_nonce_is_written_in_ansibles_own_worker_without_starting_a_python(tmp_path):
    # A module would start an interpreter (0.7-1.0 s of every push-mode job): here none can start.
    import json

    from tests.support.ansible import run_ansible

    results = tmp_path / "results"
    results.mkdir(mode=0o755)
    nonce_file = results / "42" / "attempt-0" / "preflight.nonce"
    args = {"nonce": "n0nce", "results_dir": str(results)}
    args["shared_dirs"] = [{"name": "results_dir", "path": str(results), "nonce_file": str(nonce_file)}]
    argv = ["ansible", "localhost", "-c", "local", "-m", "preflight_nonce", "-a", json.dumps(args)]
    written = run_ansible([*argv, "-e", "ansible_python_interpreter=/bin/false"])
    assert written.returncode == 0, written.stdout + written.stderr
    assert nonce_file.read_text() == "n0nce"


def test_the_disk_check_asks_room_for_a_given_manifests_image_measured_in_the_cache(tmp_path):
    image_id = "sha256:" + "ab" * 32
    (tmp_path / ("ab" * 32 + ".tar")).write_bytes(b"x" * 3000)
    assert preflight.known_image_bytes([image_id], str(tmp_path)) == 3000
    # Neither the cache nor this node's Docker knows it: unknown, not 0.
    assert preflight.known_image_bytes(["sha256:" + "cd" * 32], str(tmp_path)) is None
    assert preflight.known_image_bytes([], str(tmp_path)) is None


def test_the_disk_check_leaves_the_size_unknown_for_a_manifests_image_id_the_cache_cannot_name(tmp_path):
    # A given manifest's image_id that is no sha256 ID: the check asks the headroom alone, it does not stop.
    assert preflight.known_image_bytes(["ci-dummy:latest"], str(tmp_path)) is None


def test_the_disk_check_measures_an_image_this_nodes_docker_holds(private_dockerd, busybox_image, monkeypatch):
    _, image_id = busybox_image
    monkeypatch.setenv("DOCKER_HOST", private_dockerd.host)
    size = int(private_dockerd.docker("image", "inspect", "--format", "{{.Size}}", image_id).stdout.strip())
    assert preflight.known_image_bytes([image_id], None) == size > 0


SLOW_START_PLAY = """
- name: The preflight role alone, its clock check only, on localhost as a one-node push-mode run
  hosts: all
  gather_facts: false
  vars_files:
    - {root}/group_vars/all.yml
  roles:
    - role: preflight
"""


def test_the_clock_check_does_not_count_a_slow_start_of_the_check_as_skew(tmp_path):
    """Under load (srun to many nodes, a busy controller) a node's check starts seconds after the controller sent
    it. Here the node's Python starts 6 s late against a 5 s bound: the node's clock is right, so no problem."""
    slow_python = tmp_path / "slow-python"
    slow_python.write_text(f'#!/bin/sh\nsleep 6\nexec {sys.executable} "$@"\n')
    slow_python.chmod(0o755)
    play = tmp_path / "play.yml"
    play.write_text(SLOW_START_PLAY.format(root=ROOT))
    (tmp_path / "inventory.ini").write_text("[primary]\nlocalhost\n")
    extra = {
        "results_dir": str(tmp_path / "results"),
        "image_cache_dir": str(tmp_path / "cache"),
        "preflight_checks": ["clock"],
        "preflight_max_clock_skew": 5,
        "node_rank": 0,
        "nnodes": 1,
        "slurm_job_id": "slow-start",
        "allocation_nodes": ["localhost"],
        "ansible_connection": "local",
        "ansible_python_interpreter": str(slow_python),
    }
    done = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(tmp_path / "inventory.ini"), str(play), "-e", json.dumps(extra)],
        cwd=ROOT,
        env=dict(ansible_env(), ANSIBLE_INVENTORY_ENABLED="ini"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "clock is" not in done.stdout


def test_a_user_the_docker_daemon_refuses_is_told_dockers_own_words_and_the_fix(private_dockerd):
    # A real daemon, a real ordinary user it does not let in (its socket is root's alone): the docker CLI's
    # EACCES, not its template error, and the fix in the problem itself (what the verdict and the CLI show).
    from tests.support.users.local_users import USER, ensure_user, run_as, system_python

    ensure_user(USER)
    env = ["env", f"DOCKER_HOST={private_dockerd.host}", "SLURMD_NODENAME=node9", f"PYTHONPATH={ROOT / 'collections'}"]
    argv = [system_python(), "-S", "-m", PREFLIGHT[-1], "--json", json.dumps({"checks": ["docker"]})]
    out = run_as(USER, [*env, *argv])
    assert out.returncode == 1, out.stderr
    (found,) = json.loads(out.stdout)["problems"]
    said = found["problem"]
    assert f"Docker refuses {USER}" in said and "on node9" in said, said
    assert "permission denied while trying to connect to the Docker daemon socket" in said, said
    assert "template:" not in said and "nil pointer" not in said, said
    for fix in ("to the docker group", "rootless Docker", "container_runtime: charliecloud"):
        assert fix in said and fix in found["fix"], said
