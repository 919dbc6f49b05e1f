"""module_utils/job/defaults.py is the one home of the results dir, image cache dir and image transport defaults,
and of the numeric settings several layers need (SETTING_DEFAULTS): group_vars/all.yml reads it through the
`pipeline_default` filter, the modules' options, the checks' own fallbacks, the CLI and node selection import it."""

import importlib.util
import json
import time

import pytest
import yaml

from ansible.module_utils.job import defaults
from ansible.module_utils.node import preflight
from slurm_multi.spec import JobSpec
from slurm_multi.submission import node_selection
from slurm_multi.submission.sbatch import SlurmOptions
from tests.support.ansible import ROOT, ansible_env, run_ansible

# Each numeric setting's options in the modules that take it (a module called directly gets the same default).
# rank_barrier's and run_model's heartbeat_stale default to 0, off: a module called alone watches no heartbeat.
MODULE_OPTIONS = [
    ("preflight_max_clock_skew", "node_preflight", "max_clock_skew"),
    ("preflight_disk_headroom_gb", "node_preflight", "disk_headroom_gb"),
    ("image_cache_keep", "image_cache", "keep"),
    ("barrier_timeout", "rank_barrier", "timeout"),
    ("heartbeat_stale", "image_stream", "heartbeat_stale"),
]

SHOW_DEFAULTS = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.debug:
        msg: "{{ {'results_dir': results_dir, 'image_cache_dir': image_cache_dir, 'image_transport': image_transport,
                  'preflight_max_clock_skew': preflight_max_clock_skew,
                  'preflight_disk_headroom_gb': preflight_disk_headroom_gb,
                  'image_cache_keep': image_cache_keep, 'barrier_timeout': barrier_timeout,
                  'heartbeat_stale': heartbeat_stale} | to_json }}"
"""


def test_the_results_dir_is_the_environments_else_one_in_home():
    assert defaults.default_results_dir({"HOME": "/home/alice"}) == "/home/alice/slurm-multi-results"
    environ = {"HOME": "/home/alice", "SLURM_MULTI_RESULTS_DIR": "/shared/results"}
    assert defaults.default_results_dir(environ) == "/shared/results"


def test_an_unknown_default_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match="no pipeline default named 'result_dir': results_dir, image_cache_dir"):
        defaults.pipeline_default("result_dir")


def test_group_vars_defaults_are_the_modules(tmp_path):
    # A playbook beside the project's group_vars, as playbooks/ has it.
    (tmp_path / "group_vars").symlink_to(ROOT / "group_vars")
    (tmp_path / "show.yml").write_text(SHOW_DEFAULTS)
    env = ansible_env(HOME=str(tmp_path), SLURM_MULTI_RESULTS_DIR=str(tmp_path / "results"))
    result = run_ansible(["ansible-playbook", "-i", "localhost,", str(tmp_path / "show.yml")], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = json.loads(result.stdout.split("msg: '", 1)[1].split("'\n", 1)[0])
    assert shown == {
        "results_dir": str(tmp_path / "results"),
        "image_cache_dir": defaults.IMAGE_CACHE_DIR,
        "image_transport": defaults.IMAGE_TRANSPORT,
        **defaults.SETTING_DEFAULTS,
    }


def _library_module(name):
    spec = importlib.util.spec_from_file_location(f"slurm_multi_library_{name}", ROOT / "library" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("setting, module_name, option", MODULE_OPTIONS)
def test_each_modules_option_and_its_doc_default_to_the_settings_one_home(setting, module_name, option):
    module = _library_module(module_name)
    documented = yaml.safe_load(module.DOCUMENTATION)["options"][option]["default"]
    assert module.ARGUMENT_SPEC[option]["default"] == documented == defaults.SETTING_DEFAULTS[setting]


def test_the_checks_own_fallbacks_are_the_one_homes(monkeypatch):
    # The checks run as a plain script too (node selection's srun), given only what the caller sets.
    home = defaults.SETTING_DEFAULTS
    skewed = preflight.node_preflight(
        {"node": "n1", "checks": ["clock"], "reference_time": time.time() - (home["preflight_max_clock_skew"] - 2)}
    )
    assert skewed["problems"] == []
    monkeypatch.setattr(preflight, "docker_root_dir", lambda node: ("/var/lib/docker", None))
    monkeypatch.setattr(preflight, "free_bytes", lambda root: int((home["preflight_disk_headroom_gb"] - 1) * 1e9))
    short = preflight.node_preflight({"node": "n1", "checks": ["disk"], "image_bytes": 1})
    assert [problem["check"] for problem in short["problems"]] == ["disk"]


def test_node_selection_checks_with_the_one_homes_defaults_and_a_users_zero(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(node_selection.sbatch, "usable_nodes", lambda partition, reservation: ["node1"])

    def run(argv, env, **_):
        seen["settings"] = json.loads(argv[argv.index("--json") + 1])
        return node_selection.subprocess.CompletedProcess(argv, 0, json.dumps({"node": "node1", "problems": []}), "")

    monkeypatch.setattr(node_selection.subprocess, "run", run)
    node_selection.select_nodes(JobSpec(tags=("dummy",), results_dir=tmp_path / "r"), SlurmOptions(nodes=1), ROOT)
    assert seen["settings"]["max_clock_skew"] == defaults.SETTING_DEFAULTS["preflight_max_clock_skew"]
    assert seen["settings"]["disk_headroom_gb"] == defaults.SETTING_DEFAULTS["preflight_disk_headroom_gb"]
    given = JobSpec(tags=("dummy",), results_dir=tmp_path / "r", extra_vars={"preflight_max_clock_skew": 0})
    node_selection.select_nodes(given, SlurmOptions(nodes=1), ROOT)
    assert seen["settings"]["max_clock_skew"] == 0
