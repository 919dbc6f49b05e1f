"""UserError, the one root of the errors the user caused: the CLI and the modules report each by its message alone,
and any other exception keeps its traceback. No test here lists the errors: each finds them all."""

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import slurm_multi
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import validate_job_id
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi import cli

ROOT = Path(__file__).resolve().parents[3]


def every_user_error() -> list:
    """Every subclass of UserError that module_utils/ and the package define, once all their modules are imported."""
    for path in sorted((ROOT / "module_utils").rglob("*.py")):
        parts = [part for part in path.relative_to(ROOT / "module_utils").with_suffix("").parts if part != "__init__"]
        importlib.import_module(".".join(["ansible_collections.slurm_multi.pipeline.plugins.module_utils", *parts]))
    for found in pkgutil.walk_packages(slurm_multi.__path__, "slurm_multi."):
        if not found.name.endswith("__main__"):
            importlib.import_module(found.name)
    errors, unseen = [], [UserError]
    while unseen:
        for subclass in unseen.pop().__subclasses__():
            errors.append(subclass)
            unseen.append(subclass)
    return errors


def carrying(error_type: type, message: str) -> Exception:
    """An `error_type` whose message is `message`, whatever else its constructor takes."""
    error = error_type.__new__(error_type)
    Exception.__init__(error, message)
    return error


def test_the_search_finds_the_errors_of_module_utils_and_of_the_package():
    modules = {error.__module__.split(".")[0] for error in every_user_error()}
    assert modules == {"ansible_collections", "slurm_multi"}


# A UserError with a second base -> the test in this file that shows which code we do not own needs that base
# (module_utils/user_error.py's rule). None needs one.
SECOND_BASE_REASONS: dict = {}


def test_a_user_error_has_one_root_unless_a_test_here_shows_why_it_needs_a_second_base():
    doubled = {error.__qualname__: [base.__name__ for base in error.__bases__] for error in every_user_error()}
    unexplained = {
        name: bases
        for name, bases in doubled.items()
        if len(bases) > 1 and SECOND_BASE_REASONS.get(name) not in globals()
    }
    assert not unexplained


def test_the_cli_ends_on_every_user_error_with_exit_code_2_and_its_message_alone(monkeypatch, capsys):
    wrong = {}
    for error_type in every_user_error():
        message = f"{error_type.__name__}: give the job another ID"

        def fail(_args, error_type=error_type, message=message):
            raise carrying(error_type, message)

        monkeypatch.setattr(cli, "_collect", fail)
        try:
            code = cli.main(["collect", "4242"])
        except Exception as escaped:  # noqa: BLE001 - the finding is which ones escape
            wrong[error_type.__qualname__] = f"escaped: {escaped!r}"
            continue
        stderr = capsys.readouterr().err
        if code != 2 or stderr != f"slurm-multi collect: error: {message}\n":
            wrong[error_type.__qualname__] = f"exit code {code}, stderr {stderr!r}"
    assert not wrong


def test_the_cli_lets_an_internal_bug_end_in_its_traceback(monkeypatch):
    def fail(_args):
        return {}["job_id"]

    monkeypatch.setattr(cli, "_collect", fail)
    with pytest.raises(KeyError):
        cli.main(["collect", "4242"])


# A module whose run_module runs `body`, run as Ansible's debug entry point runs one (its args as JSON on the command
# line), its module_utils importable by their collection's name: a real AnsibleModule in a process of its own.
_DEMO_MODULE = """
import sys
sys.path.insert(0, {root!r})
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import validate_job_id
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors

def run_module(module):
    {body}

run_reporting_unexpected_errors(AnsibleModule(argument_spec={{}}), run_module, "demo", changed=False)
"""


def module_result(body: str, **module_args) -> dict:
    """The result of the demo module whose run_module runs `body`."""
    done = subprocess.run(
        [sys.executable, "-c", _DEMO_MODULE.format(root=str(ROOT), body=body)]
        + [json.dumps({"ANSIBLE_MODULE_ARGS": module_args})],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    return json.loads(done.stdout)


def test_a_module_fails_on_a_user_error_with_its_message_and_no_traceback():
    with pytest.raises(UserError) as raised:
        validate_job_id("../4242")

    result = module_result('validate_job_id("../4242")')
    assert result["failed"] is True
    assert result["msg"] == str(raised.value)
    assert "exception" not in result


def test_a_module_fails_on_a_user_error_with_its_failure_fields():
    assert module_result('validate_job_id("../4242")')["changed"] is False


def test_a_module_fails_on_an_internal_bug_with_its_type_and_traceback():
    # As `ANSIBLE_DISPLAY_TRACEBACK=error` asks it: since ansible-core 2.19 a result carries a traceback only then.
    result = module_result('return {}["job_id"]', _ansible_tracebacks_for=["error"])
    assert result["msg"] == "demo failed unexpectedly: KeyError: 'job_id'"
    assert "Traceback" in result["exception"]
    assert result["changed"] is False
