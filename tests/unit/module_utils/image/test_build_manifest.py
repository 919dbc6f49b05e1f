"""models.json cards, --tags selection, and build_manifest.json read and written in MAD's shape."""

import json
import os
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    ManifestError,
    card_tags,
    load_manifest,
    load_model_cards,
    manifest_context,
    new_manifest,
    select_model_cards,
    validate_manifest,
    write_manifest,
)

FIXTURE_ZOO = Path(__file__).resolve().parents[3] / "fixtures" / "model_zoo"

# A manifest as MAD writes it (trimmed from a real `madengine build`), with keys we do not know.
MAD_MANIFEST = {
    "built_images": {
        "ci-dummy_dummy.ubuntu.amd": {
            "docker_image": "ci-dummy_dummy.ubuntu.amd",
            "dockerfile": "docker/dummy.ubuntu.amd.Dockerfile",
            "base_docker": "rocm/pytorch:latest",
            "docker_sha": "sha256:abc",
            "build_duration": 12.5,
            "build_command": "docker build --network=host -t ci-dummy_dummy.ubuntu.amd --pull -f ... ./docker",
            "log_file": "dummy_dummy.ubuntu.amd.build.live.log",
            "gpu_architecture": "gfx942",
        }
    },
    "built_models": {"ci-dummy_dummy.ubuntu.amd": {"name": "dummy", "dockerfile": "docker/dummy", "args": ""}},
    "context": {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}"}, "gpu_vendor": "AMD"},
    "credentials_required": [],
    "deployment_config": {"slurm": {"partition": "gpu"}},
}


def write_json(path, data):
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# --- models.json -------------------------------------------------------------------------------------------------


def test_loads_the_cards_of_a_zoo_with_unknown_keys_kept():
    cards = load_model_cards(FIXTURE_ZOO / "models.json")
    assert [card["name"] for card in cards] == ["dummy", "dummy_multi", "dummy_build_args"]
    assert cards[2]["future_mad_key"] == {"kept": True}


def test_missing_models_file_is_named(tmp_path):
    with pytest.raises(ManifestError, match=f"models file {tmp_path}/models.json does not exist"):
        load_model_cards(tmp_path / "models.json")


def test_malformed_models_file_gives_line_and_column(tmp_path):
    path = write_json(tmp_path / "models.json", '[\n  {"name": "a",\n   "dockerfile" "docker/a"}\n]')
    expected = r"models\.json is not valid JSON: Expecting ':' delimiter at line 3 column"
    with pytest.raises(ManifestError, match=expected):
        load_model_cards(path)


def test_models_file_that_is_not_a_list_is_refused(tmp_path):
    path = write_json(tmp_path / "models.json", {"name": "a"})
    with pytest.raises(ManifestError, match="must hold a JSON list of model cards"):
        load_model_cards(path)


def test_card_without_name_is_refused_with_its_index(tmp_path):
    path = write_json(tmp_path / "models.json", [{"name": "a", "dockerfile": "docker/a"}, {"dockerfile": "docker/b"}])
    with pytest.raises(ManifestError, match="model card #1 has no 'name'"):
        load_model_cards(path)


def test_card_without_dockerfile_is_refused_with_its_name(tmp_path):
    path = write_json(tmp_path / "models.json", [{"name": "a"}])
    with pytest.raises(ManifestError, match="model 'a' has no 'dockerfile'"):
        load_model_cards(path)


def test_duplicate_card_names_are_refused(tmp_path):
    path = write_json(
        tmp_path / "models.json", [{"name": "a", "dockerfile": "d/a"}, {"name": "a", "dockerfile": "d/b"}]
    )
    with pytest.raises(ManifestError, match="two model cards are named 'a'"):
        load_model_cards(path)


def test_nested_models_json_cards_are_prefixed_with_their_directory(tmp_path):
    write_json(tmp_path / "models.json", [{"name": "a", "dockerfile": "docker/a"}])
    (tmp_path / "scripts" / "team").mkdir(parents=True)
    write_json(
        tmp_path / "scripts" / "team" / "models.json",
        [{"name": "b", "dockerfile": "docker/b", "scripts": "b/run.sh", "tags": ["inference"]}],
    )
    nested = load_model_cards(tmp_path / "models.json")[1]
    assert (nested["name"], nested["dockerfile"], nested["scripts"]) == (
        "team/b",
        os.path.join("scripts", "team", "docker", "b"),
        os.path.join("scripts", "team", "b", "run.sh"),
    )


def test_card_tags_accept_mads_comma_separated_string():
    assert card_tags({"tags": "a, b,,c"}) == ["a", "b", "c"]


# --- --tags ------------------------------------------------------------------------------------------------------

CARDS = [
    {"name": "dummy", "dockerfile": "docker/dummy", "tags": ["dummies"], "args": ""},
    {"name": "dummy_multi", "dockerfile": "docker/dummy", "tags": ["dummies", "multi"], "args": "--batch-size 8"},
    {"name": "team/infer", "dockerfile": "x", "tags": ["inference"]},
    {"name": "solo_infer", "dockerfile": "x", "tags": ["inference"]},
]


def selected_names(tags):
    return [card["name"] for card in select_model_cards(CARDS, tags)]


def test_tag_equal_to_a_name_selects_that_card():
    assert selected_names(["dummy"]) == ["dummy"]


def test_tag_selects_every_card_carrying_it():
    assert selected_names(["dummies"]) == ["dummy", "dummy_multi"]


def test_all_selects_every_card():
    assert selected_names(["all"]) == [card["name"] for card in CARDS]


def test_card_selected_by_two_tags_is_selected_once():
    assert selected_names(["dummy", "dummies"]) == ["dummy", "dummy_multi"]


def test_scoped_tag_selects_within_its_directory():
    assert selected_names(["team/inference"]) == ["team/infer"]


def test_tag_options_become_extra_script_args():
    card = select_model_cards(CARDS, ["dummy_multi:epochs=2:fast"])[0]
    assert card["args"] == "--batch-size 8 --epochs 2 --fast"


def test_selection_does_not_modify_the_cards():
    select_model_cards(CARDS, ["dummy_multi:epochs=2"])
    assert CARDS[1]["args"] == "--batch-size 8"


def test_same_card_with_different_extra_args_is_refused():
    with pytest.raises(ManifestError, match="'dummy' is selected twice with different arguments"):
        select_model_cards(CARDS, ["dummy:a=1", "dummy:a=2"])


def test_unknown_tag_lists_available_names_and_tags():
    with pytest.raises(ManifestError) as error:
        select_model_cards(CARDS, ["dumy"])
    assert str(error.value) == (
        "tag 'dumy' matches no model. Model names: dummy, dummy_multi, solo_infer, team/infer. "
        "Tags: dummies, inference, multi"
    )


def test_no_tags_is_an_error():
    with pytest.raises(ManifestError, match="no tags given"):
        select_model_cards(CARDS, [])


# --- build_manifest.json -----------------------------------------------------------------------------------------


def test_reads_a_mad_manifest_as_is(tmp_path):
    path = write_json(tmp_path / "build_manifest.json", MAD_MANIFEST)
    assert load_manifest(path) == MAD_MANIFEST


def test_missing_manifest_is_named(tmp_path):
    with pytest.raises(ManifestError, match=f"build manifest {tmp_path}/none.json does not exist"):
        load_manifest(tmp_path / "none.json")


def test_malformed_manifest_gives_line_and_column(tmp_path):
    path = write_json(tmp_path / "build_manifest.json", '{\n  "built_images": {},\n  "built_models": {,}\n}')
    with pytest.raises(ManifestError, match="is not valid JSON: Expecting property name .* at line 3 column 20"):
        load_manifest(path)


@pytest.mark.parametrize(
    "broken, message",
    [
        ({"built_models": {}}, "has no 'built_images'"),
        ({"built_images": [], "built_models": {}}, "'built_images' must be an object, not list"),
        (
            {"built_images": {"ci-x": {"dockerfile": "d"}}, "built_models": {}},
            r"built_images\['ci-x'\] has no 'docker_image'",
        ),
        ({"built_images": {}, "built_models": {"ci-x": {"args": ""}}}, r"built_models\['ci-x'\] has no model 'name'"),
        ({"built_images": {}, "built_models": {}, "context": "AMD"}, "'context' must be an object, not str"),
        ([], "the top level must be an object"),
    ],
)
def test_invalid_manifest_names_the_key_and_the_file(tmp_path, broken, message):
    path = write_json(tmp_path / "build_manifest.json", broken)
    with pytest.raises(ManifestError, match=f"build manifest {path}.*{message}"):
        load_manifest(path)


def test_write_then_read_round_trips_unknown_keys(tmp_path):
    path = tmp_path / "out" / "build_manifest.json"
    write_manifest(path, MAD_MANIFEST)
    assert load_manifest(path) == MAD_MANIFEST


def test_write_replaces_the_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "build_manifest.json"
    write_manifest(path, MAD_MANIFEST)
    write_manifest(path, dict(MAD_MANIFEST, deployment_config={}))
    assert json.loads(path.read_text())["deployment_config"] == {}
    assert os.listdir(tmp_path) == ["build_manifest.json"]


def test_invalid_manifest_is_not_written(tmp_path):
    path = write_json(tmp_path / "build_manifest.json", MAD_MANIFEST)
    with pytest.raises(ManifestError):
        write_manifest(path, {"built_images": {}})
    assert load_manifest(path) == MAD_MANIFEST


def test_manifest_context_records_mads_keys_only():
    recorded = manifest_context(
        {"gpu_vendor": "AMD", "guest_os": "UBUNTU", "docker_gpus": "0", "host_os": "X", "node_rank": 0}
    )
    assert recorded == {
        "gpu_vendor": "AMD",
        "guest_os": "UBUNTU",
        "docker_gpus": "0",
        "docker_env_vars": {},
        "docker_mounts": {},
        "docker_build_arg": {},
    }


def test_manifest_context_writes_secrets_as_placeholders():
    recorded = manifest_context(
        {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "hf_real"}, "docker_build_arg": {"MAD_SECRETS_PIP": "pip_real"}}
    )
    assert "hf_real" not in json.dumps(recorded) and "pip_real" not in json.dumps(recorded)
    assert recorded["docker_env_vars"]["MAD_SECRETS_HFTOKEN"] == "${MAD_SECRETS_HFTOKEN}"


def test_new_manifest_has_mads_top_level_keys():
    manifest = new_manifest({}, {}, {"gpu_vendor": "AMD"}, {"slurm": {}})
    assert sorted(manifest) == ["built_images", "built_models", "context", "deployment_config"]
    assert validate_manifest(manifest) is manifest


def test_the_records_model_comes_from_a_manifest_or_is_empty_with_a_warning_when_it_cannot_be_read(tmp_path, capsys):
    from plugins.filter.run_context import manifest_model

    good = tmp_path / "build_manifest.json"
    write_json(good, MAD_MANIFEST)
    assert manifest_model(str(good)) == next(iter(MAD_MANIFEST["built_models"].values()))
    broken = tmp_path / "broken.json"
    broken.write_text('{"built_images": {"dummy": {"docker_image": "dummy"}, ')
    for path in (broken, tmp_path / "missing.json"):
        assert manifest_model(str(path)) == {}
        assert path.name in capsys.readouterr().err
