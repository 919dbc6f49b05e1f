"""The repo passes its static checks: ansible-lint (production profile), every playbook's syntax check, every custom
module's documentation as ansible-doc renders it (with its check_mode/diff_mode attributes, every option its argument
spec takes, fragments merged, and the timed step it returns), the one error idiom of every module's main(), and ruff."""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import step_record
from tests.conftest import ROOT

VENV_BIN = Path(sys.executable).parent
PLAYBOOKS = sorted(path.name for path in (ROOT / "playbooks").glob("*.yml"))
MODULES = sorted(path.stem for path in (ROOT / "library").glob("*.py"))


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    """One of the venv's Ansible tools, from the repo root with its ansible.cfg, no colours."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", NO_COLOR="1", PY_COLORS="0")
    return subprocess.run(
        [str(VENV_BIN / argv[0]), *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


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


SUPPORT_LEVELS = {"full", "partial", "none", "N/A"}


@pytest.fixture(scope="module")
def rendered_docs():
    """Every module's documentation as ansible-doc renders it, doc fragments merged: one call for all of them."""
    result = run_tool("ansible-doc", "-M", "library", "--json", *MODULES)
    assert result.returncode == 0, f"ansible-doc -M library --json failed:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.mark.parametrize("module", MODULES)
def test_module_declares_its_check_and_diff_mode_support(module, rendered_docs):
    attributes = rendered_docs[module]["doc"].get("attributes", {})
    for name in ("check_mode", "diff_mode"):
        attribute = attributes.get(name)
        assert attribute, (
            f"library/{module}.py declares no attributes.{name}: add it to DOCUMENTATION beside "
            "extends_documentation_fragment: [slurm_multi.pipeline.module_attributes] (see library/registry_pull.py)"
        )
        assert attribute.get("support") in SUPPORT_LEVELS, f"{module} {name}: support must be one of {SUPPORT_LEVELS}"
        assert attribute.get("description"), f"{module} {name}: no description (plugins/doc_fragments)"


def _module_tree(module: str) -> ast.AST:
    return ast.parse((ROOT / "library" / f"{module}.py").read_text(encoding="utf-8"))


def _argument_spec(module: str) -> dict:
    """The argument_spec the module hands AnsibleModule, evaluated among the module's own names."""
    path = ROOT / "library" / f"{module}.py"
    loaded = importlib.util.module_from_spec(importlib.util.spec_from_file_location(f"library_{module}", path))
    loaded.__spec__.loader.exec_module(loaded)
    call = next(
        node
        for node in ast.walk(_module_tree(module))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "AnsibleModule"
    )
    spec = next(keyword.value for keyword in call.keywords if keyword.arg == "argument_spec")
    return eval(compile(ast.Expression(spec), str(path), "eval"), vars(loaded))


def _as_documented(options: dict, nested: str) -> dict:
    """What a user reads of each option (ansible-doc's defaults filled in); `nested` names the sub-options' key."""
    return {
        name: {
            "type": option.get("type", "str"),
            "default": option.get("default"),
            "required": option.get("required", False),
            "choices": option.get("choices"),
            "elements": option.get("elements"),
            **({"options": _as_documented(option[nested], nested)} if option.get(nested) else {}),
        }
        for name, option in options.items()
    }


@pytest.mark.parametrize("module", MODULES)
def test_module_documents_every_option_its_argument_spec_takes(module, rendered_docs):
    # The options a module shares with others (docker_host, docker_timeout) are documented once, in
    # plugins/doc_fragments: this is what holds each module's own spec to that one text.
    taken = _as_documented(_argument_spec(module), nested="options")
    documented = _as_documented(rendered_docs[module]["doc"].get("options", {}), nested="suboptions")
    assert documented == taken, (
        f"library/{module}.py: its options as ansible-doc renders them (DOCUMENTATION and its doc fragments) differ "
        f"from its argument_spec:\n  documented: {documented}\n  taken:      {taken}"
    )


def _times_a_step(module: str) -> bool:
    """Whether main() has module_runner time the module's work as a timeline step (its results then carry `step`)."""
    return any(
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "run_reporting_unexpected_errors"
        and any(keyword.arg == "step" for keyword in node.keywords)
        for node in ast.walk(_module_tree(module))
    )


TIMED_MODULES = [module for module in MODULES if _times_a_step(module)]


def test_the_timed_modules_are_found():
    assert {"build_images", "rank_barrier", "node_preflight"} <= set(TIMED_MODULES), TIMED_MODULES


@pytest.mark.parametrize("module", TIMED_MODULES)
def test_a_timed_module_documents_the_step_it_returns(module, rendered_docs):
    # ansible-core 2.19 renders no RETURN doc fragment (plugins/doc_fragments/docker_cli.py says why), so each
    # module writes `step` out; this keeps the copies saying the same of what module_runner.timed_step returns.
    step = rendered_docs[module]["return"].get("step")
    assert step, f"library/{module}.py returns `step` (main() passes step= to module_runner) but its RETURN omits it"
    assert (step["type"], step["returned"]) == ("dict", "always, but in check mode"), step
    assert set(step.get("sample") or {}) == {"name", *step_record(0.0)}, step


def _handlers_of(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, ast.ExceptHandler)]


def _catches_everything(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return caught is None or any(
        isinstance(name, ast.Name) and name.id in ("Exception", "BaseException") for name in names
    )


@pytest.mark.parametrize("module", MODULES)
def test_module_reports_unexpected_errors_through_module_runner(module):
    tree = _module_tree(module)
    main = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"), None)
    assert main is not None, f"library/{module}.py has no main()"
    calls = [node.func.id for node in ast.walk(main) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    assert "run_reporting_unexpected_errors" in calls, (
        f"library/{module}.py: main() must hand its run_module to module_runner.run_reporting_unexpected_errors, "
        "the one place an unexpected exception becomes a failed task with its traceback"
    )
    catch_alls = [handler.lineno for handler in _handlers_of(tree) if _catches_everything(handler)]
    assert not catch_alls, (
        f"library/{module}.py catches every exception itself (line(s) {catch_alls}): catch only "
        "the expected errors and leave the rest to module_runner"
    )


def test_ruff_finds_nothing():
    result = run_tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, f"ruff check . found problems (pyproject.toml [tool.ruff]):\n{result.stdout[-6000:]}"


def test_the_tree_is_formatted_by_ruff():
    result = run_tool("ruff", "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, f"run `ruff format .`; these files differ from its layout:\n{result.stdout[-6000:]}"
