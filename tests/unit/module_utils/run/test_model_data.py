"""A card's data as MAD names it (module_utils/run/model_data.py): data.json's local provider mounted where madengine
mounts it, with its variables; every other provider refused by name, before anything is queued."""

import json
import shutil
from pathlib import Path

import pytest

import slurm_multi
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_data import (
    ModelDataError,
    card_data,
    data_config,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRunError,
    docker_run_args,
    validate,
)
from plugins.filter.run_context import card_data as card_data_filter
from tests.unit.module_utils.run.test_launchers import model_run

ROOT = Path(__file__).resolve().parents[4]


def test_a_local_provider_is_mounted_read_only_at_madengines_data_home_with_its_variables():
    entries = {"mnist": {"local": {"path": "/shared/datasets/mnist"}}}
    assert card_data({"name": "m", "data": "mnist"}, entries) == {
        "mounts": ["/shared/datasets/mnist:/data_dlm_0:ro"],
        "env": {"MAD_DATAHOME": "/data_dlm_0", "MAD_DATANAME": "mnist"},
    }


def test_several_data_get_a_home_each_a_given_home_and_readwrite_kept():
    entries = {
        "a": {"local": {"path": "/shared/a"}},
        "b": {"local": {"path": "/shared/b", "home": "/data/b", "readwrite": "true"}},
    }
    data = card_data({"name": "m", "data": "a,b"}, entries)
    assert data["mounts"] == ["/shared/a:/data_dlm_0:ro", "/shared/b:/data/b"]
    assert data["env"] == {"MAD_DATAHOME": "/data_dlm_0,/data/b", "MAD_DATANAME": "a,b"}


def test_a_card_without_data_gets_nothing():
    assert card_data({"name": "m", "data": ""}, {}) == {"mounts": [], "env": {}}


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"huggingface": {"repo": "x"}}, "'huggingface' provider, which is not one of madengine's providers"),
        ({"minio": {"path": "s3://b/x"}}, "'minio' provider, which downloads from a MinIO bucket"),
        ({"aws": {"path": "s3://b/x"}}, "'aws' provider, which downloads from an S3 bucket"),
        ({"nas": {"path": "/x", "ip": "10.0.0.1"}}, "'nas' provider, which mounts a NAS over sshfs"),
        # madengine tries custom before local: the data would come from the script, not from the path.
        ({"custom": {"path": "get.sh"}, "local": {"path": "/x"}}, "'custom' provider, which runs the entry's"),
    ],
)
def test_a_provider_this_tool_does_not_implement_is_refused_by_name(entry, named):
    with pytest.raises(ModelDataError) as raised:
        card_data({"name": "m", "data": "d"}, {"d": entry})
    assert named in str(raised.value) and "implements the local provider alone" in str(raised.value)


def test_data_no_entry_defines_is_refused_naming_the_known_ones():
    with pytest.raises(ModelDataError, match=r"names data 'huggingface', which data.json does not define .*: mnist"):
        card_data({"name": "m", "data": "huggingface"}, {"mnist": {"local": {"path": "/x"}}})


def test_the_contexts_data_overrides_data_json_entry_by_entry(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps({"a": {"aws": {}}, "b": {"local": {"path": "/b"}}}))
    entries = data_config(str(tmp_path), {"data": {"a": {"local": {"path": "/a"}}}})
    assert entries == {"a": {"local": {"path": "/a"}}, "b": {"local": {"path": "/b"}}}


def test_the_run_binds_the_data_with_the_same_mounts_list_a_runtime_gets(tmp_path):
    (tmp_path / "datasets").mkdir()
    run = model_run(tmp_path, data_mounts=[f"{tmp_path}/datasets:/data_dlm_0:ro"])
    argv = docker_run_args(run, None)
    assert f"{tmp_path}/datasets:/data_dlm_0:ro" in [argv[i + 1] for i, arg in enumerate(argv) if arg == "-v"]


def test_a_data_path_missing_on_the_node_fails_the_run_before_it_starts(tmp_path):
    run = model_run(tmp_path, data_mounts=[f"{tmp_path}/absent:/data_dlm_0:ro"])
    with pytest.raises(ModelRunError, match=f"its data's local path {tmp_path}/absent does not exist on node2"):
        validate(run)


def test_the_running_stages_filter_reads_data_json_beside_the_models_file(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps({"d": {"local": {"path": "/shared/d"}}}))
    data = card_data_filter({"name": "m", "data": "d"}, str(tmp_path / "models.json"), {})
    assert data["mounts"] == ["/shared/d:/data_dlm_0:ro"]


# --- before anything is queued ------------------------------------------------------------------------------------


@pytest.fixture
def zoo(tmp_path):
    """A copy of the shipped sample zoo whose dummy card names data 'hf'."""
    zoo = tmp_path / "zoo"
    shutil.copytree(ROOT / "models", zoo)
    cards = json.loads((zoo / "models.json").read_text())
    for card in cards:
        if card["name"] == "dummy":
            card["data"] = "hf"
    (zoo / "models.json").write_text(json.dumps(cards))
    return zoo


def _spec(zoo, tmp_path):
    return slurm_multi.job_spec(["dummy"], models_file=zoo / "models.json", results_dir=tmp_path / "r", root=ROOT)


def test_a_card_whose_data_comes_from_huggingface_is_refused_before_anything_is_queued(zoo, tmp_path):
    (zoo / "data.json").write_text(json.dumps({"hf": {"huggingface": {"repo": "org/set"}}}))
    with pytest.raises(
        slurm_multi.SlurmMultiError, match=r"data 'hf' in .*data.json would come from its 'huggingface'"
    ):
        _spec(zoo, tmp_path)


def test_a_card_whose_data_is_on_shared_storage_is_accepted(zoo, tmp_path):
    (zoo / "data.json").write_text(json.dumps({"hf": {"local": {"path": str(tmp_path)}}}))
    assert _spec(zoo, tmp_path).tags == ("dummy",)
