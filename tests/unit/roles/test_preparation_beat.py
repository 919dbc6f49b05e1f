"""Pull mode's playbook heartbeat (roles/preparation, "Beat while this node's playbook lives (pull mode)"): its
file lands in the node's dir whatever characters the results dir holds, and none of them runs as shell code.

`submit` takes a results dir holding a double quote, `$(` and a backtick (the sbatch script quotes it), and so does
the API. The role's own task runs here by itself, through the real ansible-playbook (local connection), with a node
dir holding all three: the same task a pull-mode job's every node runs, in a second and without the lab."""

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.support.ansible import BIN, ROOT, ansible_env

TASK = "Beat while this node's playbook lives (pull mode)"


def _beat_play(node_dir):
    tasks = yaml.safe_load((ROOT / "roles" / "preparation" / "tasks" / "main.yml").read_text())
    (task,) = [task for task in tasks if task.get("name") == TASK]
    return [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "vars": {"pull_mode": True, "node_facts": {"node_dir": str(node_dir)}},
            "tasks": [task],
        }
    ]


def test_the_heartbeat_lands_in_a_node_dir_of_any_characters_and_runs_none_of_them(tmp_path):
    pwned = Path("/tmp") / f"slurm-multi-PWNED-{secrets.token_hex(6)}"
    ticked = Path(f"{pwned}-backtick")
    results = tmp_path / f'results "q" $(touch {pwned}) `touch {ticked}`'
    node_dir = results / "job-1" / "attempt-0" / "nodes" / "node1"
    node_dir.mkdir(parents=True)
    (tmp_path / "beat.yml").write_text(yaml.safe_dump(_beat_play(node_dir)))
    playbook = subprocess.Popen(["sleep", "120"])  # stands for the node's ansible-playbook: beaten while it lives
    try:
        ran = subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(tmp_path / "beat.yml")]
            + ["-e", f"ansible_python_interpreter={sys.executable}"],
            cwd=ROOT,
            env=ansible_env(SLURM_MULTI_PLAYBOOK_PID=str(playbook.pid)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        beat = node_dir / "playbook.alive"
        deadline = time.monotonic() + 20
        while not beat.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pwned.exists() and not ticked.exists()
        assert beat.read_text().split()[0] == str(playbook.pid)
    finally:
        playbook.kill()
        playbook.wait()
        for path in (pwned, ticked):
            if path.exists():
                os.unlink(path)
