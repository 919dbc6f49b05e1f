"""Each node's own copy of the model's scripts: what is copied, what runs, and the copy itself."""

import os

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_scripts import (
    ModelScriptsError,
    copy_scripts,
    scripts_source,
)


def _zoo(tmp_path):
    scripts = tmp_path / "scripts" / "dummy"
    scripts.mkdir(parents=True)
    (scripts / "run.sh").write_text("#!/bin/sh\n. ./common.sh\n")
    (scripts / "run_lastrank.sh").write_text("#!/bin/sh\n")
    (scripts / "common.sh").write_text("say() { echo $1; }\n")
    os.chmod(scripts / "run.sh", 0o755)
    (scripts / "data").mkdir()
    (scripts / "data" / "input.txt").write_text("x\n")
    os.symlink("run.sh", scripts / "latest.sh")
    return scripts


def test_a_script_file_runs_by_name_with_its_directory_copied(tmp_path):
    scripts = _zoo(tmp_path)
    assert scripts_source(str(scripts / "run_lastrank.sh")) == (str(scripts), "run_lastrank.sh")


def test_a_scripts_directory_runs_its_run_sh(tmp_path):
    scripts = _zoo(tmp_path)
    assert scripts_source(str(scripts)) == (str(scripts), "run.sh")


def test_missing_scripts_are_an_error_naming_the_path_and_the_card_field(tmp_path):
    with pytest.raises(ModelScriptsError) as error:
        scripts_source(str(tmp_path / "scripts" / "nope.sh"))
    assert "nope.sh" in str(error.value) and "`scripts`" in str(error.value)


def test_every_workspace_gets_the_whole_directory_with_modes_and_symlinks(tmp_path):
    scripts = _zoo(tmp_path)
    workspaces = [str(tmp_path / "results" / node / "workspace") for node in ("node1", "node2")]
    assert copy_scripts(str(scripts), workspaces) == workspaces
    for workspace in workspaces:
        assert sorted(os.listdir(workspace)) == ["common.sh", "data", "latest.sh", "run.sh", "run_lastrank.sh"]
        assert (os.stat(os.path.join(workspace, "run.sh")).st_mode & 0o777) == 0o755
        assert os.readlink(os.path.join(workspace, "latest.sh")) == "run.sh"
        with open(os.path.join(workspace, "data", "input.txt")) as copied:
            assert copied.read() == "x\n"


def test_a_nodes_writes_stay_in_its_own_workspace(tmp_path):
    scripts = _zoo(tmp_path)
    first, second = (str(tmp_path / node) for node in ("node1", "node2"))
    copy_scripts(str(scripts), [first, second])
    with open(os.path.join(first, "common.sh"), "w") as changed:
        changed.write("changed\n")
    assert (scripts / "common.sh").read_text() == "say() { echo $1; }\n"
    with open(os.path.join(second, "common.sh")) as other:
        assert other.read() == "say() { echo $1; }\n"


def test_a_workspace_that_exists_gets_the_files_replaced(tmp_path):
    scripts = _zoo(tmp_path)
    workspace = tmp_path / "node1"
    workspace.mkdir()
    (workspace / "run.sh").write_text("old\n")
    (workspace / "results.csv").write_text("kept\n")
    copy_scripts(str(scripts), [str(workspace)])
    assert (workspace / "run.sh").read_text() == "#!/bin/sh\n. ./common.sh\n"
    assert (workspace / "results.csv").read_text() == "kept\n"


def test_a_workspace_that_cannot_be_made_is_an_error_naming_it(tmp_path):
    scripts = _zoo(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ModelScriptsError, match="into " + str(blocker / "workspace")):
        copy_scripts(str(scripts), [str(blocker / "workspace")])
