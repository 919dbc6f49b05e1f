"""The repo's Ansible content passes its static checks: ansible-lint (production profile), every playbook's
syntax check, and every custom module's documentation as ansible-doc renders it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

VENV_BIN = Path(sys.executable).parent
PLAYBOOKS = sorted(path.name for path in (ROOT / "playbooks").glob("*.yml"))
MODULES = sorted(path.stem for path in (ROOT / "library").glob("*.py"))


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    """One of the venv's Ansible tools, from the repo root with its ansible.cfg, no colours."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", NO_COLOR="1", PY_COLORS="0")
    return subprocess.run([str(VENV_BIN / argv[0]), *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_ansible_lint_passes_the_production_profile():
    result = run_tool("ansible-lint", "--nocolor")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"ansible-lint found violations:\n{output[-6000:]}"
    assert "Profile 'production' was required, and it passed" in output, output[-3000:]


def test_every_playbook_and_module_is_checked():
    assert "run_multi.yml" in PLAYBOOKS and len(MODULES) >= 5, (PLAYBOOKS, MODULES)


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbook_passes_syntax_check(playbook):
    result = run_tool("ansible-playbook", "--syntax-check", f"playbooks/{playbook}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"ansible-playbook --syntax-check playbooks/{playbook} failed:\n{output}"
    assert f"playbook: playbooks/{playbook}" in output, output


@pytest.mark.parametrize("module", MODULES)
def test_module_documentation_renders(module):
    result = run_tool("ansible-doc", "-M", "library", module)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"ansible-doc -M library {module} failed:\n{output}"
    assert f"MODULE {module} (" in result.stdout, output[:2000]
    for section in ("OPTIONS", "EXAMPLES:", "RETURN VALUES:"):
        assert section in result.stdout, f"ansible-doc {module} renders no {section} section:\n{result.stdout}"
    assert "WARNING" not in result.stderr, f"ansible-doc {module} warned:\n{result.stderr}"
