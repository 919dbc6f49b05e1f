"""What one module run costs on a node before the module does anything: its AnsiballZ payload read and imported.

Run anywhere (no lab): python -m benchmarks.module_start_bench [--repeat 20]
A real playbook runs Ansible's `command` module (`true`) once through a capturing interpreter, which
keeps the exact bytes Ansible pipelines to a node: once as Ansible builds them, once from the payload cache of
slurm_multi/speedup/preload.py (bytecode beside each source). Each is then fed, side by side in turn, to
  - the venv's python on stdin, as Ansible's pipelining runs it;
  - slurm-multi-module-python, the inventory's interpreter (the same Python, reading /dev/stdin in blocks);
and the CPU of each run (user + system, its children's rusage) is printed, with the read(2) count under strace when
strace is installed.
"""

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PLAY = "- hosts: localhost\n  gather_facts: false\n  tasks:\n    - ansible.builtin.command: 'true'\n"
CAPTURE = '#!/bin/sh\ntee "$CAPTURE_TO" | exec {python} /dev/stdin\n'


def pipelined_payload(work: Path, cache_home: Path, name: str) -> bytes:
    """The bytes Ansible pipes to the interpreter for the play's one module run."""
    capture = work / "capture.sh"
    capture.write_text(CAPTURE.format(python=sys.executable))
    capture.chmod(0o755)
    (work / "play.yml").write_text(PLAY)
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(cache_home),
        CAPTURE_TO=str(work / name),
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
    )
    subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(work / "play.yml")]
        + ["-e", f"ansible_python_interpreter={capture}"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    return (work / name).read_bytes()


def cpu_of(argv: list, payload: bytes) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, input=payload, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def reads_of(argv: list, payload: bytes):
    if not shutil.which("strace"):
        return None
    out = subprocess.run(
        ["strace", "-f", "-c", "-e", "trace=read", *argv], input=payload, capture_output=True, check=True
    ).stderr.decode()
    total = [line for line in out.splitlines() if line.strip().endswith("total")]
    return int(total[-1].split()[-2]) if total else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    shim = BIN / "slurm-multi-module-python"
    if not shim.exists():
        sys.exit(f"{shim} is missing: install the project into this venv (pip install -e .)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        payloads = {
            "as Ansible builds it": pipelined_payload(work, work / "cache", "built"),
            "from the payload cache (+ bytecode)": pipelined_payload(work, work / "cache", "kept"),
        }
    runners = {"python, script on stdin": [sys.executable], "slurm-multi-module-python": [str(shim)]}
    samples = {(p, r): [] for p in payloads for r in runners}
    for _ in range(args.repeat):
        for (payload, runner), cpu in samples.items():
            cpu.append(cpu_of(runners[runner], payloads[payload]))
    print(f"one `command: true` module run, CPU (user + system), median of {args.repeat}, side by side")
    for (payload, runner), cpu in samples.items():
        reads = reads_of(runners[runner], payloads[payload])
        print(
            f"  {payload:36} {len(payloads[payload]) / 1024:6.0f} KB  {runner:26} "
            f"{statistics.median(cpu):.3f} s" + (f"  {reads} read(2) calls" if reads is not None else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
