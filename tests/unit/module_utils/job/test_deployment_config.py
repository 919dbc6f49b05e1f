"""The job's config: MAD's deployment_config, --config, the additional context and the SLURM options, checked and
merged in one order (module_utils/deployment_config, through `job_spec` and `slurm_options` as users reach it)."""

import json
from pathlib import Path

import pytest

import slurm_multi
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    new_manifest,
    write_manifest,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.deployment_config import (
    DeploymentConfigError,
    check_config,
    manifest_deployment_config,
    read_config_file,
)
from plugins.filter.run_context import restore_run_context
from tests.unit.module_utils.image.test_build_manifest import MAD_MANIFEST

ROOT = Path(__file__).resolve().parents[4]

# One SLURM key per source: each source sets its own key and every key above it, so each key shows which source
# won it (the highest source that set it), and that it beat every source below.
SOURCES = ("manifest", "config", "file", "c", "flags")
KEYS = ("partition", "reservation", "account", "qos", "exclude")


def _layer(index):
    return {"slurm": {key: SOURCES[index] for key in KEYS[index:]}}


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


def _spec(tmp_path, **options):
    return slurm_multi.job_spec(["dummy"], results_dir=tmp_path / "results", root=ROOT, **options)


@pytest.fixture
def every_source(tmp_path):
    """The job_spec arguments giving every source its layer."""
    manifest = _write(tmp_path / "build_manifest.json", dict(MAD_MANIFEST, deployment_config=_layer(0)))
    return {
        "manifest_path": manifest,
        "config": _write(tmp_path / "deployment.json", _layer(1)),
        "additional_context_file": _write(tmp_path / "context.json", _layer(2)),
        "additional_context": json.dumps(_layer(3)),
        "slurm_overrides": _layer(4)["slurm"],
    }


# --- precedence -------------------------------------------------------------------------------------------------


def test_each_source_overrides_every_source_below_it(tmp_path, every_source):
    slurm = _spec(tmp_path, **every_source).additional_context["slurm"]
    assert slurm == dict(zip(KEYS, SOURCES, strict=True))


def test_the_sbatch_options_follow_the_same_order(tmp_path, every_source):
    spec = _spec(tmp_path, **every_source)
    options = slurm_multi.slurm_options(2, context=spec.additional_context)
    assert [getattr(options, key) for key in KEYS] == list(SOURCES)


@pytest.mark.parametrize("missing", SOURCES[:-1])
def test_without_a_source_the_one_below_wins_its_key(tmp_path, every_source, missing):
    argument = dict(zip(SOURCES, every_source, strict=True))[missing]
    del every_source[argument]
    slurm = _spec(tmp_path, **every_source).additional_context["slurm"]
    index = SOURCES.index(missing)
    assert slurm.get(KEYS[index]) == (SOURCES[index - 1] if index else None)


def test_the_default_context_lies_beneath_the_jobs_config(tmp_path):
    default_context = SETTING_DEFAULTS[
        "default_context"
    ]  # group_vars' (tests/unit/module_utils/job/test_pipeline_defaults.py)
    manifest = _write(
        tmp_path / "build_manifest.json",
        dict(MAD_MANIFEST, deployment_config={"guest_os": "CENTOS", "docker_env_vars": {"A": "manifest"}}),
    )
    spec = _spec(tmp_path, manifest_path=manifest, additional_context={"docker_env_vars": {"B": "c"}})

    node_context = restore_run_context(default_context, {}, spec.additional_context, {})

    assert default_context["guest_os"] == "UBUNTU"
    assert node_context["guest_os"] == "CENTOS"
    assert node_context["docker_env_vars"] == {"A": "manifest", "B": "c"}
    assert node_context["docker_mounts"] == {}  # a default no source set stays


def test_a_nested_override_keeps_its_siblings(tmp_path):
    config = _write(
        tmp_path / "deployment.json", {"slurm": {"node_selector": {"partition": "gpu", "reservation": "a"}}}
    )
    spec = _spec(tmp_path, config=config, additional_context={"slurm": {"node_selector": {"reservation": "b"}}})
    options = slurm_multi.slurm_options(2, context=spec.additional_context)
    assert (options.partition, options.reservation) == ("gpu", "b")


def test_a_node_selector_setting_overrides_the_same_setting_of_a_lower_source(tmp_path):
    config = _write(tmp_path / "deployment.json", {"slurm": {"partition": "low", "exclusive": False}})
    spec = _spec(tmp_path, config=config, additional_context={"slurm": {"node_selector": {"partition": "high"}}})
    assert spec.additional_context["slurm"] == {"partition": "high", "exclusive": False}


def test_the_config_may_be_given_as_an_object(tmp_path):
    spec = _spec(tmp_path, config={"slurm": {"nodes": 3, "time": "01:00:00"}, "gpu_vendor": "AMD"})
    options = slurm_multi.slurm_options(context=spec.additional_context)
    assert (options.nodes, options.time, spec.additional_context["gpu_vendor"]) == (3, "01:00:00", "AMD")


def test_a_madengine_example_config_with_comments_is_accepted(tmp_path):
    config = {
        "_comment": "SGLang Disaggregated Multi-Node",
        "_architecture": {"proxy": "Node 0"},
        "gpu_vendor": "AMD",
        "guest_os": "UBUNTU",
        "slurm": {"partition": "amd-rccl", "nodes": 5, "gpus_per_node": 8, "time": "04:00:00", "exclusive": True},
        "distributed": {"launcher": "slurm_multi", "nnodes": 5},
        "env_vars": {"NCCL_DEBUG": "WARN"},
    }
    context = read_config_file(_write(tmp_path / "deployment.json", config))
    assert "_comment" not in context and context["slurm"]["nodes"] == 5


def test_madengine_slurm_keys_without_meaning_here_are_accepted():
    config = {"slurm": {"output_dir": "./out", "modules": [], "enable_node_check": True, "nodes": 2}}
    assert check_config(config, "--config x", strict=True)["slurm"]["output_dir"] == "./out"


def test_a_context_filter_key_may_come_with_c_but_not_in_a_deployment_config(tmp_path):
    assert _spec(tmp_path, additional_context={"ctx_test": 2}).additional_context == {"ctx_test": 2}
    with pytest.raises(
        slurm_multi.SlurmMultiError, match=r"unknown key 'ctx_test'.*give a Dockerfile CONTEXT key with -c"
    ):
        _spec(tmp_path, config={"ctx_test": 2})


# --- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"slrum": {"nodes": 2}}, "unknown key 'slrum' (did you mean 'slurm'?)"),
        ({"Slurm": {"nodes": 2}}, "unknown key 'Slurm' (did you mean 'slurm'?)"),
        ({"gpu_vender": "AMD"}, "unknown key 'gpu_vender' (did you mean 'gpu_vendor'?)"),
        ({"no_such_setting": 1}, "unknown key 'no_such_setting'"),
        ({"slurm": {"partiton": "gpu"}}, "unknown key 'slurm.partiton' (did you mean 'slurm.partition'?)"),
        ({"slurm": {"Nodes": 2}}, "unknown key 'slurm.Nodes' (did you mean 'slurm.nodes'?)"),
        (
            {"slurm": {"node_selector": {"reservaton": "r"}}},
            "unknown key 'slurm.node_selector.reservaton' (did you mean 'slurm.node_selector.reservation'?)",
        ),
        ({"slurm": {"modules": "rocm/6.2.0"}}, "slurm.modules must be a list of environment module names"),
        ({"slurm": {"modules": ["rocm; rm -rf ~"]}}, "slurm.modules must be a list of environment module names"),
        ({"slurm": {"network_interface": "ib0 eth0"}}, "slurm.network_interface holds whitespace"),
        ({"slurm": {"network_interface": 0}}, "slurm.network_interface must be a non-empty string, not int"),
        ({"slurm": {"output_dir": ""}}, "slurm.output_dir must be a non-empty string"),
        ({"slurm": {"shared_workspace": ["/a"]}}, "slurm.shared_workspace must be a non-empty string, not list"),
        ({"slurm": ["nodes", 2]}, "slurm must be an object"),
        ({"slurm": {"node_selector": "gpu"}}, "slurm.node_selector must be an object"),
        ({"docker_env_vars": ["A=1"]}, "docker_env_vars must be an object"),
        (
            {"slurm": {"partition": "a", "node_selector": {"partition": "b"}}},
            "slurm.partition and slurm.node_selector.partition have different values",
        ),
    ],
)
def test_a_bad_deployment_config_is_refused_naming_the_file_and_the_key(tmp_path, config, message):
    path = _write(tmp_path / "deployment.json", config)
    with pytest.raises(slurm_multi.SlurmMultiError) as raised:
        _spec(tmp_path, config=path)
    assert str(raised.value).startswith(f"--config {path}: ")
    assert message in str(raised.value)


@pytest.mark.parametrize("section", ["slrum", "Slurm", "SLURM"])
def test_a_misspelt_section_in_c_is_refused_too(tmp_path, section):
    with pytest.raises(slurm_multi.SlurmMultiError, match=rf"--additional-context: unknown key '{section}' .*'slurm'"):
        _spec(tmp_path, additional_context={section: {"partition": "gpu"}})


def test_a_misspelt_slurm_key_in_the_additional_context_file_is_refused(tmp_path):
    path = _write(tmp_path / "context.json", {"slurm": {"reservaton": "r"}})
    with pytest.raises(slurm_multi.SlurmMultiError, match=rf"{path}: unknown key 'slurm.reservaton'"):
        _spec(tmp_path, additional_context_file=path)


def test_a_misspelt_key_in_the_manifests_deployment_config_is_refused_naming_the_manifest(tmp_path):
    manifest = _write(tmp_path / "build_manifest.json", dict(MAD_MANIFEST, deployment_config={"slurm": {"tim": 5}}))
    with pytest.raises(
        slurm_multi.SlurmMultiError, match=rf"build manifest {manifest}'s deployment_config: .*'slurm.time'"
    ):
        _spec(tmp_path, manifest_path=manifest)


def test_a_bad_slurm_option_of_the_api_is_refused(tmp_path):
    with pytest.raises(slurm_multi.SlurmMultiError, match=r"the SLURM options: unknown key 'slurm.partiton'"):
        _spec(tmp_path, slurm_overrides={"partiton": "gpu"})


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(slurm_multi.SlurmMultiError, match=f"cannot read the deployment config {tmp_path}/nope.json"):
        _spec(tmp_path, config=tmp_path / "nope.json")


def test_a_config_that_is_not_json_is_refused_with_the_position(tmp_path):
    path = tmp_path / "deployment.json"
    path.write_text('{"slurm": {"nodes": 2}')
    with pytest.raises(
        slurm_multi.SlurmMultiError, match=rf"--config {path} is neither a JSON object .* line 1 column"
    ):
        _spec(tmp_path, config=path)


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    with pytest.raises(slurm_multi.SlurmMultiError, match=r"must be a JSON object"):
        _spec(tmp_path, config=_write(tmp_path / "deployment.json", [{"slurm": {}}]))


def test_a_literal_secret_in_the_config_is_refused_and_not_repeated(tmp_path):
    config = {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "hf_literal_in_config"}}
    with pytest.raises(slurm_multi.SlurmMultiError) as raised:
        _spec(tmp_path, config=_write(tmp_path / "deployment.json", config))
    assert "docker_env_vars.MAD_SECRETS_HFTOKEN a literal value" in str(raised.value)
    assert "hf_literal_in_config" not in str(raised.value)


def test_refusals_name_keys_and_types_never_values():
    for config in ({"slurm": "hf_value_shown"}, {"docker_env_vars": "hf_value_shown"}):
        with pytest.raises(DeploymentConfigError) as raised:
            check_config(config, "-c")
        assert "hf_value_shown" not in str(raised.value) and "not a str" in str(raised.value)


# --- the manifest's record ---------------------------------------------------------------------------------------


def test_a_manifest_records_the_deployment_sections_of_the_jobs_config_in_mads_shape():
    config = {
        "gpu_vendor": "AMD",
        "docker_env_vars": {"A": "1"},
        "slurm": {"nodes": 2, "partition": "gpu"},
        "distributed": {"launcher": "torchrun", "env": {"MAD_SECRETS_DB": "db_literal_value"}},
        "env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}", "NCCL_DEBUG": "WARN"},
    }
    recorded = manifest_deployment_config(config)
    assert recorded == {
        "slurm": {"nodes": 2, "partition": "gpu"},
        "distributed": {"launcher": "torchrun", "env": {"MAD_SECRETS_DB": "${MAD_SECRETS_DB}"}},
        "env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}", "NCCL_DEBUG": "WARN"},
    }
    assert "db_literal_value" not in json.dumps(new_manifest({}, {}, config, config))


def test_the_config_a_build_recorded_comes_back_as_the_lowest_source_of_a_manifest_run(tmp_path):
    job = _spec(tmp_path, config={"slurm": {"nodes": 3, "node_selector": {"partition": "gpu"}, "time": "60"}})
    manifest = tmp_path / "build_manifest.json"
    built = new_manifest(MAD_MANIFEST["built_images"], MAD_MANIFEST["built_models"], {}, job.additional_context)
    write_manifest(manifest, built)

    rerun = _spec(tmp_path, manifest_path=manifest, additional_context={"slurm": {"time": "30"}})

    assert rerun.additional_context["slurm"] == {"nodes": 3, "partition": "gpu", "time": "30"}


@pytest.mark.parametrize("value", ["false", "no", 0])
def test_an_exclusive_that_is_not_true_or_false_is_refused(tmp_path, value):
    with pytest.raises(slurm_multi.SlurmMultiError, match=r"slurm.exclusive must be true or false"):
        _spec(tmp_path, config={"slurm": {"exclusive": value}})


def test_a_config_may_give_the_time_and_the_gpus_as_numbers(tmp_path):
    spec = _spec(tmp_path, config={"slurm": {"nodes": 2, "time": 90, "gpus_per_node": 8}})
    options = slurm_multi.slurm_options(context=spec.additional_context)
    assert (options.time, options.gpus_per_node) == ("90", "8")


@pytest.mark.parametrize(
    ("slurm", "message"),
    [
        ({"nodes": "two"}, "--nodes must be a whole number"),
        ({"nodes": 2, "time": "soon"}, "--time 'soon' is not a SLURM time limit"),
        ({"nodes": 2, "node_selector": {"partition": "gpu --uid=0"}}, "--partition 'gpu --uid=0' contains whitespace"),
    ],
)
def test_a_bad_slurm_value_of_the_config_is_refused_naming_the_option(tmp_path, slurm, message):
    spec = _spec(tmp_path, config={"slurm": slurm})
    with pytest.raises(slurm_multi.SlurmMultiError, match=message):
        slurm_multi.slurm_options(context=spec.additional_context)


def test_without_a_node_count_anywhere_the_refusal_names_every_place_to_give_it(tmp_path):
    with pytest.raises(slurm_multi.SlurmMultiError, match=r"give --nodes N \(or slurm.nodes in --config or -c\)"):
        slurm_multi.slurm_options(context=_spec(tmp_path, config={"slurm": {"time": "60"}}).additional_context)
