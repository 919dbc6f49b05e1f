"""Restoring the build's context on a node, merging contexts, and parsing MAD's --additional-context."""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import (
    RunContextError,
    deep_merge,
    expand_placeholders,
    parse_additional_context,
    read_additional_context_file,
    redact_secrets,
    restore_context,
)


def restore(manifest_context, runtime_context=None, environ=None, **options):
    warnings = []
    restored = restore_context(manifest_context, runtime_context or {}, environ or {}, warn=warnings.append, **options)
    return restored, warnings


# --- restore_context: what comes back from the manifest ---------------------------------------------------------


def test_restores_every_build_key_missing_at_runtime():
    manifest = {
        "docker_mounts": {"/data": "/shared/data"},
        "docker_build_arg": {"BASE_DOCKER": "rocm/pytorch:latest"},
        "docker_gpus": "0,1",
        "gpu_vendor": "AMD",
        "guest_os": "UBUNTU",
        "docker_env_vars": {"NCCL_DEBUG": "INFO"},
    }
    restored, _ = restore(manifest)
    assert restored == manifest


def test_keys_outside_the_restored_set_are_not_taken_from_the_manifest():
    restored, _ = restore({"gpu_vendor": "AMD", "host_os": "HOST_CENTOS"}, {"host_os": "HOST_UBUNTU"})
    assert restored == {"gpu_vendor": "AMD", "host_os": "HOST_UBUNTU"}


def test_runtime_scalar_wins_over_manifest_scalar():
    restored, _ = restore({"gpu_vendor": "NVIDIA", "docker_gpus": "0-7"}, {"gpu_vendor": "AMD", "docker_gpus": "0,1"})
    assert (restored["gpu_vendor"], restored["docker_gpus"]) == ("AMD", "0,1")


def test_empty_runtime_scalar_counts_as_not_detected():
    restored, _ = restore({"guest_os": "UBUNTU"}, {"guest_os": ""})
    assert restored["guest_os"] == "UBUNTU"


def test_mapping_keys_merge_entry_by_entry_with_runtime_entries_winning():
    restored, _ = restore(
        {"docker_env_vars": {"NCCL_DEBUG": "INFO", "MAD_GPU_VENDOR": "NVIDIA"}},
        {"docker_env_vars": {"MAD_GPU_VENDOR": "AMD"}},
    )
    assert restored["docker_env_vars"] == {"NCCL_DEBUG": "INFO", "MAD_GPU_VENDOR": "AMD"}


def test_inputs_are_not_modified():
    manifest = {"docker_env_vars": {"A": "1"}}
    runtime = {"docker_env_vars": {"B": "2"}}
    restore(manifest, runtime)
    assert manifest == {"docker_env_vars": {"A": "1"}} and runtime == {"docker_env_vars": {"B": "2"}}


def test_manifest_mapping_that_is_not_an_object_is_refused_with_its_key():
    with pytest.raises(RunContextError, match="docker_mounts must be an object"):
        restore({"docker_mounts": ["/data:/data"]})


# --- restore_context: ${VAR} placeholders (the HF 401 bug) -----------------------------------------------------


def test_placeholder_takes_the_environment_value_not_the_literal():
    restored, _ = restore(
        {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}"}},
        environ={"MAD_SECRETS_HFTOKEN": "hf_real_token"},
    )
    assert restored["docker_env_vars"]["MAD_SECRETS_HFTOKEN"] == "hf_real_token"


def test_bare_dollar_placeholder_is_resolved_too():
    restored, _ = restore({"docker_env_vars": {"HF_HOME": "$HF_HOME"}}, environ={"HF_HOME": "/cache/hf"})
    assert restored["docker_env_vars"]["HF_HOME"] == "/cache/hf"


def test_placeholder_never_overwrites_a_runtime_value():
    restored, _ = restore(
        {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}"}},
        {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "hf_runtime"}},
        environ={},
    )
    assert restored["docker_env_vars"]["MAD_SECRETS_HFTOKEN"] == "hf_runtime"


def test_placeholder_without_environment_value_is_dropped_not_passed_literally():
    restored, _ = restore({"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}", "A": "1"}})
    assert restored["docker_env_vars"] == {"A": "1"}


def test_dropped_placeholder_warns_with_key_and_variable_name():
    _, warnings = restore({"docker_env_vars": {"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}"}})
    assert len(warnings) == 1
    assert "context.docker_env_vars.HF_TOKEN" in warnings[0] and "MAD_SECRETS_HFTOKEN" in warnings[0]


def test_warning_never_shows_a_value():
    _, warnings = restore(
        {"docker_env_vars": {"URL": "https://user:pw-secret@host/${MISSING}"}},
        environ={"OTHER": "hf_should_not_show"},
    )
    assert "pw-secret" not in warnings[0] and "hf_should_not_show" not in warnings[0]


def test_embedded_placeholder_is_expanded_within_the_value():
    restored, _ = restore({"docker_mounts": {"/data": "${SCRATCH}/data"}}, environ={"SCRATCH": "/scratch/u1"})
    assert restored["docker_mounts"] == {"/data": "/scratch/u1/data"}


def test_scalar_placeholder_without_environment_value_is_left_unset():
    restored, warnings = restore({"gpu_vendor": "${GPU_VENDOR}"})
    assert "gpu_vendor" not in restored and warnings


def test_defer_secrets_keeps_secret_placeholders_for_the_run_module():
    restored, warnings = restore(
        {"docker_env_vars": {"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}"}},
        environ={"MAD_SECRETS_HFTOKEN": "hf_real_token"},
        defer_secrets=True,
    )
    assert restored["docker_env_vars"]["HF_TOKEN"] == "${MAD_SECRETS_HFTOKEN}" and not warnings


def test_default_warning_is_a_runtime_warning():
    with pytest.warns(RuntimeWarning, match="MAD_SECRETS_HFTOKEN"):
        restore_context({"docker_env_vars": {"T": "${MAD_SECRETS_HFTOKEN}"}}, {}, {})


def test_expand_placeholders_leaves_other_dollar_signs_alone():
    assert expand_placeholders("cost $5 and $(id)", {}) == "cost $5 and $(id)"


def test_redact_secrets_replaces_secret_values_by_their_placeholder():
    redacted = redact_secrets(
        {"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "hf_x", "A": "1"}, "docker_build_arg": {"MAD_SECRETS_PIP": "p"}}
    )
    assert redacted["docker_env_vars"] == {"MAD_SECRETS_HFTOKEN": "${MAD_SECRETS_HFTOKEN}", "A": "1"}
    assert redacted["docker_build_arg"] == {"MAD_SECRETS_PIP": "${MAD_SECRETS_PIP}"}


def test_redacted_context_restores_to_the_environment_value():
    redacted = redact_secrets({"docker_env_vars": {"MAD_SECRETS_HFTOKEN": "hf_old"}})
    restored, _ = restore(redacted, environ={"MAD_SECRETS_HFTOKEN": "hf_new"})
    assert restored["docker_env_vars"]["MAD_SECRETS_HFTOKEN"] == "hf_new"


# --- deep_merge and layering ------------------------------------------------------------------------------------


def test_deep_merge_keeps_nested_siblings():
    base = {"slurm": {"node_selector": {"partition": "gpu", "reservation": "old"}, "nodes": 2}}
    override = {"slurm": {"node_selector": {"reservation": "new"}}}
    assert deep_merge(base, override) == {
        "slurm": {"node_selector": {"partition": "gpu", "reservation": "new"}, "nodes": 2}
    }


def test_deep_merge_replaces_lists_whole():
    assert deep_merge({"nodes": ["a", "b"]}, {"nodes": ["c"]}) == {"nodes": ["c"]}


def test_deep_merge_replaces_an_object_by_a_scalar():
    assert deep_merge({"slurm": {"nodes": 2}}, {"slurm": None}) == {"slurm": None}


def test_deep_merge_does_not_modify_its_inputs():
    base, override = {"a": {"b": 1}}, {"a": {"c": 2}}
    merged = deep_merge(base, override)
    merged["a"]["b"] = 99
    assert base == {"a": {"b": 1}} and override == {"a": {"c": 2}}


# --- --additional-context -----------------------------------------------------------------------------------


def test_parses_json_object():
    assert parse_additional_context('{"gpu_vendor": "AMD", "debug": true}') == {"gpu_vendor": "AMD", "debug": True}


def test_parses_mads_python_dict_form():
    assert parse_additional_context("{'gpu_vendor': 'AMD', 'debug': True, 'n': None}") == {
        "gpu_vendor": "AMD",
        "debug": True,
        "n": None,
    }


def test_empty_additional_context_is_an_empty_dict():
    assert parse_additional_context("  ") == {}


def test_json_error_gives_line_and_column():
    with pytest.raises(RunContextError, match="Expecting value at line 1 column 17"):
        parse_additional_context('{"gpu_vendors": AMD}')


def test_python_form_error_gives_line_and_column():
    with pytest.raises(RunContextError, match="line 1 column 26"):
        parse_additional_context("{'gpu_vendor': 'AMD', 'n': }")


def test_python_form_error_column_counts_leading_blanks():
    with pytest.raises(RunContextError, match="line 1 column 28"):
        parse_additional_context("  {'gpu_vendor': 'AMD', 'n': }")


def test_error_names_the_source_and_an_example():
    with pytest.raises(RunContextError, match=r'--additional-context is neither a JSON object.*e\.g\. \{"gpu_vendor"'):
        parse_additional_context("{gpu_vendor: AMD}")


def test_non_object_is_refused():
    with pytest.raises(RunContextError, match="must be a JSON object"):
        parse_additional_context('["gpu_vendor", "AMD"]')


def test_python_values_json_cannot_hold_are_refused():
    with pytest.raises(RunContextError, match=r"context\.gpus: a set is not a JSON value"):
        parse_additional_context("{'gpus': {0, 1}}", source="context")


def test_python_expressions_are_not_evaluated():
    with pytest.raises(RunContextError):
        parse_additional_context("{'a': __import__('os').getcwd()}")


def test_additional_context_file_errors_name_the_file(tmp_path):
    path = tmp_path / "ctx.json"
    path.write_text('{"gpu_vendor": }')
    with pytest.raises(RunContextError, match=f"{path} is neither a JSON object"):
        read_additional_context_file(path)


def test_missing_additional_context_file_is_reported(tmp_path):
    with pytest.raises(RunContextError, match="cannot read the additional context file"):
        read_additional_context_file(tmp_path / "missing.json")
