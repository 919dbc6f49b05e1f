"""Ansible's real pipelined payloads, as the module server receives them: captured from a real ansible-playbook, and
changed as a payload built from a changed checkout would be."""

import base64
import io
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support.ansible import BIN, ROOT


def captured_payload(work: Path, task: str = "command: echo through the payload", library=None) -> bytes:
    """The bytes Ansible pipelines for `task` (a capturing interpreter keeps them); modules from `library` too."""
    capture = work / "capture.sh"
    capture.write_text(f'#!/bin/sh\ntee "{work / "payload"}" | exec {sys.executable} /dev/stdin\n')
    capture.chmod(0o755)
    play = work / "play.yml"
    play.write_text(f"- hosts: localhost\n  gather_facts: false\n  tasks:\n    - {task}\n")
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    if library:
        env["ANSIBLE_LIBRARY"] = f"{library}:{ROOT / 'library'}"
    subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play)]
        + ["-e", f"ansible_python_interpreter={capture}"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    return (work / "payload").read_bytes()


def with_changed_source(payload: bytes, path: str, appended: bytes) -> bytes:
    """`payload` with `appended` added to the source in its zip whose name ends with `path` (and that source's
    bytecode left out, which would stand for the old source): a payload built from a changed checkout."""
    encoded = max(re.findall(rb"'([A-Za-z0-9+/=]{1000,})'", payload), key=len)
    changed = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(encoded))) as old, zipfile.ZipFile(changed, "w") as new:
        for entry in old.infolist():
            if entry.filename.endswith(path + "c"):
                continue
            data = old.read(entry)
            new.writestr(entry, data + appended if entry.filename.endswith(path) else data)
    return payload.replace(encoded, base64.b64encode(changed.getvalue()))
