"""MAD's tools (the context's `tools`), merged as madengine's apply_tools merges them, and the script that runs them.

madengine's own tools.json, unchanged, is tests/fixtures/mad_tools/scripts/common/tools.json. madengine's order
(execution/container_runner.py): each tool's pre_scripts go before those gathered so far and its post_scripts after;
its cmd goes in front of the wrapped command (once per distinct cmd); its env_vars always apply.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_run_spec import (
    ModelRun,
    ModelRunError,
    plan_model_run,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.tools import (
    PYSPY_TOOL,
    ToolsError,
    apply_tools,
    find_pyspy,
    known_tools,
    read_tools_file,
    tool_outputs,
)

MAD_TOOLS = Path(__file__).resolve().parents[3] / "fixtures" / "mad_tools" / "scripts" / "common" / "tools.json"
MODEL = ["sh", "-c", "echo model", "img"]


def applied(*tools, tools_file=MAD_TOOLS):
    return apply_tools(list(tools), known_tools(str(tools_file)), str(tools_file))


def test_madengines_own_tools_file_is_read_unchanged_with_every_tool_it_defines():
    tools = read_tools_file(str(MAD_TOOLS))
    assert {"rocprof", "rccl_trace", "rpd", "test_tools_A", "test_tools_B", "gpu_info_power_profiler"} <= set(tools)
    assert len(tools) == len(json.loads(MAD_TOOLS.read_text())["tools"])


def test_tools_a_then_b_run_pre_b_pre_a_then_cmd_b_cmd_a_around_the_model_then_post_a_post_b():
    script = applied({"name": "test_tools_A"}, {"name": "test_tools_B"}).script(MODEL).splitlines()
    assert script == [
        "cp -LRp /myworkspace/scripts/common/test_echo.sh . || exit",
        "bash test_echo.sh pre_script B || exit",
        "cp -LRp /myworkspace/scripts/common/test_echo.sh . || exit",
        "bash test_echo.sh pre_script A || exit",
        "(echo cmd_B &&  echo cmd_A &&   sh -c 'echo model' img) || exit",
        "cp -LRp /myworkspace/scripts/common/test_echo.sh . || exit",
        "bash test_echo.sh post_script A || exit",
        "cp -LRp /myworkspace/scripts/common/test_echo.sh . || exit",
        "bash test_echo.sh post_script B || exit",
    ]


def test_rocprof_wraps_the_model_in_mads_wrapper_found_from_the_working_dir_and_collects_its_trace_after():
    # A GPU tool: only its wrapping is tested here (no GPU in the lab).
    tools = applied({"name": "rocprof"})
    script = tools.script(MODEL).splitlines()
    assert (
        script[0]
        == "(bash ../scripts/common/tools/rocprof_wrapper.sh --runtime-trace --  sh -c 'echo model' img) || exit"
    )
    assert script[1:] == [
        "cp -LRp /myworkspace/scripts/common/post_scripts/trace.sh . || exit",
        "bash trace.sh rocprof || exit",
    ]
    assert tools.env_vars == {}


def test_library_traces_sharing_one_wrapper_wrap_the_model_once_and_set_every_tools_variable():
    tools = applied({"name": "rccl_trace"}, {"name": "rocblas_trace"})
    assert (
        tools.script(MODEL) == "(python3 ../scripts/common/tools/get_library_trace.py  sh -c 'echo model' img) || exit"
    )
    assert tools.env_vars == {"RCCL_TRACE": "1", "ROCBLAS_TRACE": "1"}
    assert tools.names == ["rccl_trace", "rocblas_trace"]


def test_our_pyspy_record_wraps_the_models_own_command_wherever_the_context_lists_it():
    # madengine's text composition would put it in front of `echo cmd_B && ...`: it would record `echo cmd_B`.
    script = applied({"name": "test_tools_A"}, {"name": "test_tools_B"}, {"name": PYSPY_TOOL}).script(MODEL)
    model_line = script.split("pre_script A || exit\n")[1].split(" || exit\n")[0]  # the recorder's source has lines
    assert model_line.startswith("(echo cmd_B &&  echo cmd_A &&   python3 -c '")
    assert model_line.endswith("' sh -c 'echo model' img)")


def test_a_context_entrys_cmd_replaces_the_tools_and_its_env_vars_go_over_the_tools():
    tools = applied(
        {"name": "rocprofv3_communication", "cmd": "rocprofv3 --rccl-trace --", "env_vars": {"RCCL_DEBUG": "WARN"}},
        {"name": "gpu_info_power_profiler", "env_vars": {"POWER_SAMPLING_RATE": 1}},
    )
    assert tools.script(MODEL).splitlines()[4] == "( rocprofv3 --rccl-trace --  sh -c 'echo model' img) || exit"
    assert tools.env_vars["RCCL_DEBUG"] == "WARN" and tools.env_vars["POWER_SAMPLING_RATE"] == "1"
    assert tools.env_vars["POWER_DEVICE"] == "all"


def test_the_tools_file_wins_over_our_own_tool_of_the_same_name(tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps({"tools": {PYSPY_TOOL: {"cmd": "mine"}}}))
    assert known_tools(str(tmp_path / "tools.json"))[PYSPY_TOOL]["cmd"] == "mine"


def test_without_a_tools_file_only_our_own_tools_are_known(tmp_path):
    assert set(known_tools(str(tmp_path / "absent.json"))) == {PYSPY_TOOL}


def test_an_unknown_tool_is_refused_listing_the_known_ones_the_closest_first():
    with pytest.raises(ToolsError, match="unknown tool 'test_tool_A'") as refused:
        applied({"name": "test_tool_A"})
    known = str(refused.value).split("the closest first: ")[1].split(", ")
    assert (
        known[:2] == ["test_tools_A", "test_tools_B"] and PYSPY_TOOL in known and str(MAD_TOOLS) in str(refused.value)
    )


def test_an_unknown_tool_without_a_tools_file_says_the_file_is_missing(tmp_path):
    with pytest.raises(ToolsError, match=r"absent.json does not exist\), the closest first: pyspy_record$"):
        applied({"name": "rocprof"}, tools_file=tmp_path / "absent.json")


def test_a_malformed_tools_file_is_refused_naming_the_file_and_the_position(tmp_path):
    (tmp_path / "tools.json").write_text('{"tools": {\n  "a": {"cmd": "x",}\n}}')
    with pytest.raises(ToolsError, match=rf"^{tmp_path}/tools.json:2:20: not valid JSON"):
        read_tools_file(str(tmp_path / "tools.json"))


@pytest.mark.parametrize(
    "tools, message",
    [
        ({"tools": []}, r'no {"tools": {name: {...}}} object'),
        ({"tools": {"t": "echo"}}, "tool t is not an object"),
        ({"tools": {"t": {"cmd": ["echo"]}}}, "tool t: cmd is not a string"),
        ({"tools": {"t": {"pre_scripts": {"path": "x"}}}}, "tool t: pre_scripts is not a list"),
        ({"tools": {"t": {"post_scripts": [{"args": "x"}]}}}, r"tool t: post_scripts\[0\] is not .* with a path"),
        ({"tools": {"t": {"env_vars": {"A B": "1"}}}}, "'A B' is not a variable name"),
        ({"tools": {"t": {"env_vars": {"A": None}}}}, "A's value is not a string or a number"),
    ],
)
def test_a_tool_of_the_wrong_shape_is_refused_naming_the_file_the_tool_and_what_is_wrong(tmp_path, tools, message):
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    with pytest.raises(ToolsError, match=message):
        read_tools_file(str(tmp_path / "tools.json"))


@pytest.mark.parametrize(
    "entry, message",
    [
        ("rocprof", r'tools\[0\] is \'rocprof\': give {"name": "rocprof"}'),
        ({"tool": "rocprof"}, r'tools\[0\] is not a {"name": ...'),
        ({"name": "rocprof", "env_vars": ["X=1"]}, r"tools\[0\]: tool rocprof: env_vars is not an object"),
    ],
)
def test_a_context_tools_entry_of_the_wrong_shape_is_refused_naming_it(entry, message):
    with pytest.raises(ToolsError, match=message):
        applied(entry)


def test_a_script_outside_mads_scripts_common_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps({"tools": {"t": {"pre_scripts": [{"path": "scripts/x/a.sh"}]}}}))
    with pytest.raises(ToolsError, match="'scripts/x/a.sh' is not under scripts/common/"):
        applied({"name": "t"}, tools_file=tmp_path / "tools.json")


def _run_script(tmp_path, model_exit):
    """The merged script of a tool whose scripts name this machine's files (absolute paths), really run."""
    for name in ("pre.sh", "post.sh"):
        (tmp_path / name).write_text(f'echo "{name} $*"; exit ${{FAIL_{name[:-3].upper()}:-0}}\n')
    tool = {
        "pre_scripts": [{"path": str(tmp_path / "pre.sh"), "args": "one two"}],
        "cmd": "echo wrapper &&",
        "env_vars": {},
        "post_scripts": [{"path": str(tmp_path / "post.sh")}],
    }
    (tmp_path / "tools.json").write_text(json.dumps({"tools": {"t": tool}}))
    script = applied({"name": "t"}, tools_file=tmp_path / "tools.json").script(
        ["sh", "-c", f"echo model; exit {model_exit}"]
    )
    work = tmp_path / "work"
    work.mkdir()
    return lambda **env: subprocess.run(
        ["bash", "-c", script], cwd=work, env=dict(os.environ, **env), capture_output=True, text=True, timeout=20
    )


def test_the_script_runs_each_step_in_madengines_order_from_the_working_dir(tmp_path):
    ran = _run_script(tmp_path, 0)()
    assert (ran.returncode, ran.stdout) == (0, "pre.sh one two\nwrapper\nmodel\npost.sh \n")
    assert (tmp_path / "work" / "pre.sh").exists()  # copied there, as madengine copies it into its run directory


def test_the_models_exit_code_is_kept_and_no_post_script_runs_after_a_failed_model_as_in_madengine(tmp_path):
    ran = _run_script(tmp_path, 3)()
    assert (ran.returncode, ran.stdout) == (3, "pre.sh one two\nwrapper\nmodel\n")


def test_a_failing_pre_script_ends_the_run_before_the_model_with_its_exit_code(tmp_path):
    ran = _run_script(tmp_path, 0)(FAIL_PRE="5")
    assert (ran.returncode, ran.stdout) == (5, "pre.sh one two\n")


def test_the_tool_outputs_are_the_files_under_the_nodes_tools_dir_relative_to_the_node_dir(tmp_path):
    (tmp_path / "tools" / "rocprof").mkdir(parents=True)
    (tmp_path / "tools" / "pyspy-rank2.svg").write_text("<svg/>")
    (tmp_path / "tools" / "rocprof" / "trace.json").write_text("{}")
    (tmp_path / "run.log").write_text("")
    assert tool_outputs(str(tmp_path)) == ["tools/pyspy-rank2.svg", "tools/rocprof/trace.json"]
    assert tool_outputs(str(tmp_path / "elsewhere")) == []


def test_py_spy_is_found_beside_the_python_running_the_module_then_on_path(tmp_path):
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "py-spy").write_text("")
    (tmp_path / "venv" / "py-spy").chmod(0o755)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "py-spy").write_text("")
    (tmp_path / "bin" / "py-spy").chmod(0o755)
    assert find_pyspy(str(tmp_path / "venv" / "python"), str(tmp_path / "bin")) == str(tmp_path / "venv" / "py-spy")
    assert find_pyspy(str(tmp_path / "python"), str(tmp_path / "bin")) == str(tmp_path / "bin" / "py-spy")
    with pytest.raises(
        ToolsError,
        match=f"py-spy .for the ranks. stacks and pyspy_record. is not on the node: none beside {tmp_path}/python nor",
    ):
        find_pyspy(str(tmp_path / "python"), str(tmp_path))


def _plan(tmp_path, tools, **options):
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "run.sh").write_text("echo model\n")
    run = ModelRun(
        job_id="4242",
        rank=1,
        nnodes=3,
        node="node2",
        model="m",
        image="img",
        model_dir=str(tmp_path / "model"),
        script="run.sh",
        results_dir=str(tmp_path / "results"),
        master_addr="127.0.0.1",
        master_port=29500,
        user="tester",
        tools=tools,
        tools_file=str(MAD_TOOLS),
        **options,
    )
    return plan_model_run(run)["docker_run_argv"]


def test_the_plan_shows_the_tools_script_their_variables_and_mounts(tmp_path):
    argv = _plan(tmp_path, [{"name": "test_tools_A"}, {"name": "rccl_trace"}])
    node_dir = tmp_path / "results" / "4242" / "attempt-0" / "nodes" / "node2"
    assert argv[argv.index("img") + 1 : argv.index("img") + 3] == ["sh", "-c"]
    assert "bash test_echo.sh pre_script A || exit" in argv[-1] and "echo cmd_A &&" in argv[-1]
    assert argv[-1].splitlines()[2].endswith("img run.sh) || exit")  # the model's own command, wrapped
    for pair in (
        ["-e", "RCCL_TRACE=1"],
        ["-e", "SLURM_MULTI_TOOLS_DIR=/slurm-multi/tools"],
        ["-v", f"{node_dir}/tools:/slurm-multi/tools"],
        ["-v", f"{MAD_TOOLS.parent}:/myworkspace/scripts/common:ro"],
    ):
        assert argv[argv.index(pair[1]) - 1] == pair[0], pair
    assert "SYS_PTRACE" not in argv


def test_with_tools_the_container_has_madengines_layout_the_model_in_the_run_directory_under_mads_root(tmp_path):
    # MAD's trace.sh copies a trace to /myworkspace/: run from there, the copy is onto itself (rpd's then fails).
    argv = _plan(tmp_path, [{"name": "rocprof"}])
    assert argv[argv.index("--workdir") + 1] == "/myworkspace/run_directory"
    assert f"{tmp_path / 'model'}:/myworkspace/run_directory" in argv


def test_pyspy_record_mounts_the_nodes_py_spy_read_only_and_lets_it_read_the_ranks(tmp_path):
    argv = _plan(tmp_path, [{"name": PYSPY_TOOL}])
    assert f"{find_pyspy()}:/slurm-multi/bin/py-spy:ro" in argv
    assert argv[argv.index("SYS_PTRACE") - 1] == "--cap-add"
    assert "-e" in argv and "PYSPY_RECORD_OPTIONS=--idle" in argv


def test_a_tool_variable_never_changes_who_or_where_the_rank_is(tmp_path):
    argv = _plan(tmp_path, [{"name": "test_tools_A", "env_vars": {"NODE_RANK": "7", "NCCL_DEBUG": "INFO"}}])
    assert "NODE_RANK=7" not in argv and "NODE_RANK=1" in argv and "NCCL_DEBUG=INFO" in argv


def test_a_run_without_tools_runs_the_models_command_as_argv(tmp_path):
    argv = _plan(tmp_path, [])
    assert argv[-2:] == ["img", "run.sh"] and "SLURM_MULTI_TOOLS_DIR=/slurm-multi/tools" not in argv
    assert argv[argv.index("--workdir") + 1] == "/myworkspace" and f"{tmp_path / 'model'}:/myworkspace" in argv


def test_an_unknown_tool_fails_the_plan_naming_the_model_and_node(tmp_path):
    with pytest.raises(ModelRunError, match="model m on node2: unknown tool 'nope'"):
        _plan(tmp_path, [{"name": "nope"}])
