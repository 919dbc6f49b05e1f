"""A module's child on the module server: the server's own imports of the project's module_utils against the
payload's, side by side (issue 45).

    python -m benchmarks.module_server_bench [--repeat 5] [--rounds 3]

A real payload (captured from ansible-playbook) of a module that imports what the run module imports (the run, the
barrier, the image handoff) goes to a real server (slurm_multi/speedup/module_server.py) through the real client, in
turns with the same payload whose wire.py differs by a comment: the server then finds a source it did not import and the
child imports the payload's own, as every child did before. Printed per module: the client's wall time and the CPU
of the server's process tree (the child's own work) per module, medians over the rounds. No lab needed.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_multi.speedup.module_server import socket_path
from tests.support.payloads import captured_payload, with_changed_source

MODULE_PYTHON = Path(sys.executable).parent / "slurm-multi-module-python"
HEAVY_MODULE_NAME = "imports_the_run"  # a module written into the bench's own library dir
HEAVY_MODULE = """from ansible.module_utils.basic import AnsibleModule
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run import run_model_container
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.barrier.node import meet_every_node
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.handoff import publish_and_announce
AnsibleModule(argument_spec={}).exit_json(changed=False)
"""


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its waited-for children (the module children the server reaped)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def per_module(payload: bytes, env: dict, server: int, repeat: int) -> tuple:
    cpu, start = tree_cpu(server), time.perf_counter()
    for _ in range(repeat):
        done = subprocess.run([str(MODULE_PYTHON)], input=payload, env=env, capture_output=True, timeout=120)
        if done.returncode != 0:
            raise SystemExit(done.stdout.decode() + done.stderr.decode())
    return (time.perf_counter() - start) / repeat, (tree_cpu(server) - cpu) / repeat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="modules per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="module-server-bench-"))
    servers = tempfile.mkdtemp(prefix="msrv-", dir="/tmp")  # a unix socket's path has at most 107 bytes
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURMD_NODENAME="bench", SLURM_MULTI_MODULE_SERVER_DIR=servers)
    server = None
    try:
        (work / "library").mkdir()
        (work / "library" / f"{HEAVY_MODULE_NAME}.py").write_text(HEAVY_MODULE)
        same = captured_payload(work, f"{HEAVY_MODULE_NAME}:", library=work / "library")
        variants = {
            "the server's imports": same,
            "the payload's own": with_changed_source(same, "module_utils/barrier/wire.py", b"# changed\n"),
        }
        server = subprocess.Popen([sys.executable, "-m", "slurm_multi.speedup.module_server"], env=env)
        while not os.path.exists(socket_path(env)):
            time.sleep(0.05)
        per_module(same, env, server.pid, 1)  # the server has imported what it imports before it serves
        figures = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, payload in variants.items():
                figures[name].append(per_module(payload, env, server.pid, args.repeat))
        print(f"a module importing the run's, the barrier's and the handoff's module_utils, {args.rounds} rounds:")
        for name, runs in figures.items():
            wall, cpu = (statistics.median(run[i] for run in runs) for i in (0, 1))
            print(f"  {name:<22} wall {wall:.3f} s, the child's CPU {cpu:.3f} s per module")
    finally:
        if server:
            server.terminate()
            server.wait(10)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(servers, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
