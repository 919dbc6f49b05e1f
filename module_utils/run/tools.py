"""MAD's profiling tools (the context's ``tools``), applied in every rank's container as madengine applies them
(docs/tools.md); `builtin_tools` is a constant so AnsiballZ ships it."""

from __future__ import annotations

import difflib
import inspect
import json
import os
import posixpath
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang import pyspy_ranks
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

# The node dir's subdir for the tools' own outputs, and where the container sees it.
TOOLS_DIR = "tools"
CONTAINER_TOOLS_DIR = "/slurm-multi/tools"
TOOLS_DIR_VARIABLE = "SLURM_MULTI_TOOLS_DIR"
# madengine's layout in the container: MAD's root (its docker workdir), its shared scripts (a tools.json names them
# relative to the root), and the run directory where the model runs.
MAD_ROOT = "/myworkspace"
MAD_SCRIPTS_COMMON = "scripts/common"
RUN_DIRECTORY = f"{MAD_ROOT}/run_directory"
PYSPY_TOOL = "pyspy_record"
PYSPY_OPTIONS_VARIABLE = "PYSPY_RECORD_OPTIONS"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# madengine runs every step under bash (docker exec ... bash -c); an image without bash runs them under sh, saying so.
_UNDER_BASH_ELSE_SH = (
    'if command -v bash >/dev/null 2>&1; then exec bash -c "$1" "$0"; fi; '
    "printf 'slurm-multi: image %s has no bash; running the tools under sh (madengine runs them with bash)\\n' "
    '"$0" >&2; '
    'exec sh -c "$1" "$0"'
)


class ToolsError(UserError):
    """A tools file, a tool or a context's ``tools`` entry that cannot be used as given; the message says what."""


def builtin_tools() -> Dict[str, Dict[str, object]]:
    """slurm-multi's own tools, in tools.json's format."""
    return {
        PYSPY_TOOL: {
            # `py-spy record` of every rank, one flame graph per rank (module_utils/run/hang/pyspy_ranks.py), by the
            # node's own py-spy, mounted read-only. Idle stacks too: a rank's time waiting in a collective is what
            # a multi-node graph must show. Blocking (py-spy's default): --nonblocking reads a rank while it runs,
            # and a torn read put a NUL into a frame's name, which made the SVG invalid XML (a lab run's rank 2).
            "pre_scripts": [],
            "cmd": f"python3 -c {shlex.quote(inspect.getsource(pyspy_ranks))}",
            "env_vars": {PYSPY_OPTIONS_VARIABLE: "--idle"},
            "post_scripts": [],
        }
    }


def _check_scripts(scripts: object, where: str) -> List[Dict[str, str]]:
    if not isinstance(scripts, list):
        raise ToolsError(f'{where} is not a list of {{"path": ..., "args": ...}} objects')
    checked = []
    for index, script in enumerate(scripts):
        if not isinstance(script, Mapping) or not isinstance(script.get("path"), str) or not script["path"].strip():
            raise ToolsError(f'{where}[{index}] is not a {{"path": ..., "args": ...}} object with a path: {script!r}')
        if not isinstance(script.get("args", ""), str):
            raise ToolsError(f"{where}[{index}]'s args is not a string: {script['args']!r}")
        checked.append({"path": script["path"].strip(), "args": script.get("args", "").strip()})
    return checked


def _check_env_vars(env_vars: object, where: str) -> Dict[str, str]:
    if not isinstance(env_vars, Mapping):
        raise ToolsError(f"{where} is not an object of variable names and values: {env_vars!r}")
    checked = {}
    for name, value in env_vars.items():
        if not _ENV_NAME.match(str(name)):
            raise ToolsError(f"{where}: {name!r} is not a variable name (letters, digits and '_')")
        if not isinstance(value, (str, int, float)):
            raise ToolsError(f"{where}: {name}'s value is not a string or a number: {value!r}")
        checked[str(name)] = str(value)
    return checked


def _check_tool(name: str, tool: object, where: str) -> Dict[str, object]:
    """A tools.json entry, checked and normalized (every key present); ``where`` names it in errors."""
    where = f"{where}: tool {name}"
    if not isinstance(tool, Mapping):
        raise ToolsError(f'{where} is not an object such as {{"cmd": ..., "env_vars": {{}}}}: {tool!r}')
    if not isinstance(tool.get("cmd", ""), str):
        raise ToolsError(f"{where}: cmd is not a string: {tool['cmd']!r}")
    return {
        "pre_scripts": _check_scripts(tool.get("pre_scripts", []), f"{where}: pre_scripts"),
        "cmd": tool.get("cmd"),
        "env_vars": _check_env_vars(tool.get("env_vars", {}), f"{where}: env_vars"),
        "post_scripts": _check_scripts(tool.get("post_scripts", []), f"{where}: post_scripts"),
    }


def read_tools_file(path: Optional[str]) -> Dict[str, Dict[str, object]]:
    """The tools a tools.json defines, checked; none where ``path`` is unset or missing."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except json.JSONDecodeError as err:
        raise ToolsError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ToolsError(f"cannot read the tools file {path}: {err}") from None
    if not isinstance(content, Mapping) or not isinstance(content.get("tools"), Mapping):
        raise ToolsError(f'{path}: not a tools file: it holds no {{"tools": {{name: {{...}}}}}} object')
    return {str(name): _check_tool(str(name), tool, path) for name, tool in content["tools"].items()}


def known_tools(tools_file: Optional[str]) -> Dict[str, Dict[str, object]]:
    """The tools a context may name: slurm-multi's own with the tools file's over them (a name there wins)."""
    return {**builtin_tools(), **read_tools_file(tools_file)}


@dataclass
class AppliedTools:
    """The context's tools merged as madengine merges them: what runs before, around and after the model."""

    names: List[str] = field(default_factory=list)
    pre_scripts: List[Dict[str, str]] = field(default_factory=list)
    # The commands put in front of the model's, outermost first (madengine's encapsulate_script), and our recorder's,
    # right in front of it.
    wrapper: str = ""
    recorder: str = ""
    post_scripts: List[Dict[str, str]] = field(default_factory=list)
    env_vars: Dict[str, str] = field(default_factory=dict)

    def script(self, model_argv: Sequence[str]) -> str:
        """The shell script the container runs: pre scripts, the wrapped model's command, post scripts."""
        steps = [line for script in self.pre_scripts for line in _script_steps(script)]
        steps.append(f"({self.wrapper} {self.recorder}{shlex.join(model_argv)}) || exit")
        steps += [line for script in self.post_scripts for line in _script_steps(script)]
        return "\n".join(steps)

    def command(self, model_argv: Sequence[str], image: str) -> List[str]:
        """The container's argv: `script` under bash (sh, with a warning naming ``image``, where it has none)."""
        return ["sh", "-c", _UNDER_BASH_ELSE_SH, image or "(unnamed)", self.script(model_argv)]

    def environment(self) -> Dict[str, str]:
        """The container's variables for the tools: theirs, and where our own write their outputs."""
        return {**self.env_vars, TOOLS_DIR_VARIABLE: CONTAINER_TOOLS_DIR}

    def mounts(self, node_dir: str, tools_file: Optional[str]) -> List[str]:
        """``host:container[:ro]`` mounts: the node's tools dir, MAD's scripts/common, the node's py-spy."""
        mounts = [f"{tools_dir(node_dir)}:{CONTAINER_TOOLS_DIR}"]
        if tools_file and os.path.isfile(tools_file):
            mounts.append(f"{os.path.dirname(os.path.realpath(tools_file))}:{MAD_ROOT}/{MAD_SCRIPTS_COMMON}:ro")
        if PYSPY_TOOL in self.names:
            mounts.append(f"{find_pyspy()}:{pyspy_ranks.PYSPY}:ro")
        return mounts

    def docker_options(self) -> List[str]:
        """py-spy reads ranks it is not the parent of: a host whose Yama ptrace_scope is 1 allows it with this only."""
        return ["--cap-add", "SYS_PTRACE"] if PYSPY_TOOL in self.names else []


def _script_steps(script: Mapping[str, str]) -> List[str]:
    """madengine's two steps for a pre or post script: copy it into the working dir, run it there with bash."""
    path = script["path"]
    if not posixpath.isabs(path):
        normalized = posixpath.normpath(path)
        if not normalized.startswith(MAD_SCRIPTS_COMMON + "/"):
            raise ToolsError(
                f"script {path!r} is not under {MAD_SCRIPTS_COMMON}/: the container gets the tools file's directory "
                f"as MAD's {MAD_SCRIPTS_COMMON} and nothing else of MAD's root (an absolute path names the image's)"
            )
        path = f"{MAD_ROOT}/{normalized}"
    # The args are shell words, as madengine passes them ("pre_script A" is two).
    run = " ".join(part for part in ("bash", shlex.quote(posixpath.basename(path)), script["args"]) if part)
    return [f"cp -LRp {shlex.quote(path)} . || exit", f"{run} || exit"]


def _unknown_tool(name: str, known: Mapping[str, object], tools_file: Optional[str]) -> ToolsError:
    closest = difflib.get_close_matches(name, sorted(known), n=len(known), cutoff=0)
    if tools_file and os.path.isfile(tools_file):
        source = f"{tools_file}'s and slurm-multi's own"
    else:
        source = f"slurm-multi's own: the tools file {tools_file or '(none given)'} does not exist"
    return ToolsError(
        f"unknown tool {name!r} in the context's tools; the known tools ({source}), the closest first: "
        f"{', '.join(closest)}"
    )


def apply_tools(
    context_tools: Sequence[object], known: Mapping[str, Mapping[str, object]], tools_file: Optional[str] = None
) -> AppliedTools:
    """The context's ``tools`` merged in its order as madengine's apply_tools does; ``known`` is `known_tools`,
    ``tools_file`` only names where they came from in an error."""
    if not isinstance(context_tools, (list, tuple)):
        raise ToolsError(f'the context\'s tools is not a list of {{"name": ...}} objects: {context_tools!r}')
    applied = AppliedTools()
    wrapped = set()
    for index, entry in enumerate(context_tools):
        where = f"the context's tools[{index}]"
        if isinstance(entry, str):
            raise ToolsError(f'{where} is {entry!r}: give {{"name": {json.dumps(entry)}}}')
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise ToolsError(f'{where} is not a {{"name": ..., "cmd"?, "env_vars"?}} object: {entry!r}')
        name = entry["name"]
        if name not in known:
            raise _unknown_tool(name, known, tools_file)
        tool = dict(known[name])
        override = _check_tool(name, {key: entry[key] for key in ("cmd", "env_vars") if key in entry}, where)
        if "cmd" in entry:
            tool["cmd"] = override["cmd"]
        tool["env_vars"] = {**tool["env_vars"], **override["env_vars"]}
        applied.names.append(name)
        applied.pre_scripts = list(tool["pre_scripts"]) + applied.pre_scripts
        applied.post_scripts += tool["post_scripts"]
        applied.env_vars.update(tool["env_vars"])
        if name == PYSPY_TOOL and tool["cmd"] is not None:
            applied.recorder = f"{tool['cmd']} "
        elif tool["cmd"] is not None and tool["cmd"] not in wrapped:
            wrapped.add(tool["cmd"])
            applied.wrapper = f"{tool['cmd']} {applied.wrapper}"
    for script in applied.pre_scripts + applied.post_scripts:
        _script_steps(script)  # a path the container cannot reach fails here, before anything starts
    return applied


def tool_names(context_tools: Sequence[Mapping[str, object]]) -> List[str]:
    """The names of the context's tools, in its order: the node status's ``tools``."""
    return [str(entry["name"]) for entry in context_tools or ()]


def tools_dir(node_dir: str) -> str:
    """``<node dir>/tools``: the tools' own outputs (SLURM_MULTI_TOOLS_DIR in the container)."""
    return os.path.join(node_dir, TOOLS_DIR)


def tool_outputs(node_dir: str) -> List[str]:
    """Every file under the node's ``tools/``, relative to the node dir, sorted: the node status's ``tool_outputs``."""
    outputs = []
    for root, _, files in os.walk(tools_dir(node_dir)):
        outputs += [os.path.relpath(os.path.join(root, name), node_dir) for name in files]
    return sorted(outputs)


def find_pyspy(executable: Optional[str] = None, search_path: Optional[str] = None) -> str:
    """The node's py-spy binary (a project dependency): beside the Python running this (its venv), else on PATH."""
    executable = executable or sys.executable
    beside = os.path.join(os.path.dirname(executable), "py-spy")
    found = beside if os.access(beside, os.X_OK) else shutil.which("py-spy", path=search_path)
    if not found:
        raise ToolsError(
            f"py-spy (for the ranks' stacks and {PYSPY_TOOL}) is not on the node: none beside {executable} nor on "
            "PATH; install slurm-multi's dependencies (pip install py-spy) into the Python that runs its modules"
        )
    return os.path.realpath(found)
