"""Run the real ansible / ansible-playbook of the project's venv, as a user would, optionally inside salloc."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def ansible_env(**extra):
    env = dict(os.environ)
    env.update(
        {
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "ANSIBLE_FORCE_COLOR": "0",
            "PATH": f"{BIN}:{env.get('PATH', '')}",
        }
    )
    # Never inherit an allocation from whoever runs the tests; the mode the lab test runs in is not one.
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_MULTI_MODE"]:
        del env[key]
    env.update(extra)
    return env


def run_ansible(argv, nodes=None, env=None, timeout=300, cwd=ROOT, nodelist=""):
    """Run an ansible command (argv[0] from the venv), inside `salloc -N nodes` (`-w nodelist` when given) when
    nodes is given."""
    command = [str(BIN / argv[0]), *argv[1:]]
    if nodes:
        command = ["salloc", "-N", str(nodes), *(["-w", nodelist] if nodelist else []), "--quiet", *command]
    return subprocess.run(command, cwd=cwd, env=env or ansible_env(), capture_output=True, text=True, timeout=timeout)


# "changed: [node1]  => {...}", or a loop item's "ok: [node1 -> node2] => (item=node2) => {...}" (the default
# callback's v2_runner_on_ok and v2_runner_item_on_ok); the JSON is last, after the item label.
_RESULT_LINE = re.compile(r"(?:ok|changed): \[(?:[^\]]+ -> )?([^\]]+)\](?: => \(item=.*?\))? => (\{.*)")


def task_results(stdout: str) -> dict:
    """{task name: {host: result}} from `ansible-playbook -v` output in the json result format
    (ANSIBLE_CALLBACK_RESULT_FORMAT=json, ANSIBLE_CALLBACK_FORMAT_PRETTY=0). A loop's item delegated to a node
    (a run-once hand-on) counts as that node's result."""
    tasks, task = {}, None
    for line in stdout.splitlines():
        if line.startswith("TASK ["):
            task = line[line.index(":") + 2 : line.rindex("]")]
        elif match := _RESULT_LINE.fullmatch(line):
            host, result = match.groups()
            tasks.setdefault(task, {})[host] = json.loads(result)
    return tasks
