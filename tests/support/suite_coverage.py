"""The suite's line coverage over the project's code (module_utils, library, plugins, slurm_multi), measured in
every Python process the suite starts: pytest, ansible-playbook on the controller and, through srun, each module on
each lab node (run from an AnsiballZ payload zip, whose paths are mapped back to the checkout's files).

    python -m tests.support.suite_coverage install DIR    # measure every venv process while SLURM_MULTI_COVERAGE is set
    python -m tests.support.suite_coverage combine DIR    # DIR/data/* -> DIR/covered.json, DIR/.coverage
    python -m tests.support.suite_coverage compare BEFORE.json AFTER.json [BEFORE_COMMIT]

Each process records under the static context of its pipeline mode (push, pull; `none` outside a mode), so the
report shows what each mode covered. `make coverage` runs the whole suite this way.

When the code itself changed between the two runs, BEFORE_COMMIT (the commit BEFORE.json was measured on) maps each
line it covered to the same line in this checkout, through a diff of the file; a line the change rewrote or removed
has no counterpart, and compare counts those apart instead of calling them lost.
"""

import difflib
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ("module_utils", "library", "plugins", "slurm_multi")
# The `.pth` line: a process of this venv starts coverage when SLURM_MULTI_COVERAGE names the config. The name
# starts with SLURM_MULTI_ so the srun connection's environment allowlist passes it to every job step.
PTH_NAME = "zz_slurm_multi_suite_coverage.pth"
PTH_LINE = (
    'import os; (os.environ.setdefault("COVERAGE_PROCESS_START", os.environ["SLURM_MULTI_COVERAGE"]),'
    ' __import__("coverage").process_startup()) if os.environ.get("SLURM_MULTI_COVERAGE") else None\n'
)
CONFIG = """[run]
parallel = true
data_file = {data}/.coverage
context = ${{SLURM_MULTI_MODE-none}}
include =
    */module_utils/*
    */ansible/modules/*
    */library/*
    */plugins/*
    */slurm_multi/*
omit =
    */site-packages/*
    */dist-packages/*
"""
# Where a measured file of this project lives in the checkout: in any checkout (a CI clone, the baseline's) or in
# a module's payload zip (.../ansible_<module>_payload.zip/ansible/modules/<module>.py,
# .../ansible_collections/slurm_multi/pipeline/plugins/module_utils/).
_PLACES = (
    (re.compile(r"/ansible/modules/([^/]+\.py)$"), "library/{}"),
    (
        re.compile(r"_payload\.zip/ansible_collections/slurm_multi/pipeline/plugins/module_utils/(.+\.py)$"),
        "module_utils/{}",
    ),
    (re.compile(r"/((?:module_utils|library|plugins|slurm_multi)/.+\.py)$"), "{}"),
)


def install(directory: Path) -> Path:
    """Write DIR/coverage.cfg and the venv's .pth; returns the config, for SLURM_MULTI_COVERAGE."""
    (directory / "data").mkdir(parents=True, exist_ok=True)
    config = directory / "coverage.cfg"
    config.write_text(CONFIG.format(data=directory / "data"))
    Path(sysconfig.get_paths()["purelib"], PTH_NAME).write_text(PTH_LINE)
    return config


def checkout_path(measured: str) -> str | None:
    """The checkout-relative path of a measured file, or None when it is no file of this project."""
    for pattern, place in _PLACES:
        found = pattern.search(measured)
        if found:
            relative = place.format(found.group(1))
            return relative if (ROOT / relative).is_file() else None
    return None


def combine(directory: Path) -> dict:
    """{context: {file: [covered lines]}} over every data file in DIR/data, also written to DIR/covered.json, and
    DIR/.coverage (checkout paths, one context per mode) for `coverage report --data-file`."""
    covered: dict = {}
    for data_file in sorted((directory / "data").glob(".coverage*")):
        data = coverage.CoverageData(basename=str(data_file))
        try:
            data.read()
        except coverage.CoverageException:
            continue  # a process killed while writing its data (a fault test's SIGKILL)
        for context in data.measured_contexts() or {"none"}:
            data.set_query_contexts([re.escape(context)])
            for measured in data.measured_files():
                relative = checkout_path(measured)
                if relative:
                    lines = covered.setdefault(context or "none", {}).setdefault(relative, set())
                    lines.update(data.lines(measured) or ())
    result = {ctx: {path: sorted(lines) for path, lines in sorted(files.items())} for ctx, files in covered.items()}
    (directory / "covered.json").write_text(json.dumps(result, indent=1))
    combined = coverage.CoverageData(basename=str(directory / ".coverage"))
    combined.erase()
    for context, files in result.items():
        combined.set_context(context)
        combined.add_lines({str(ROOT / path): lines for path, lines in files.items()})
    combined.write()
    return result


def line_map(old_text: str, new_text: str) -> dict[int, int]:
    """{line in the old text: the same line in the new one}, for the lines the change left as they were."""
    old, new = old_text.splitlines(), new_text.splitlines()
    kept = difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks()
    return {a + 1 + k: b + 1 + k for a, b, size in kept for k in range(size)}


def moved_lines(before_commit: str):
    """path -> its line map from BEFORE_COMMIT to this checkout (None where the file is new or gone)."""
    maps: dict = {}

    def mapping(path):
        if path not in maps:
            old = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{before_commit}:{path}"], capture_output=True, text=True
            )
            new = ROOT / path
            maps[path] = line_map(old.stdout, new.read_text()) if old.returncode == 0 and new.is_file() else None
        return maps[path]

    return mapping


def compare(before: dict, after: dict, moved=None) -> tuple[list[str], int]:
    """Lines covered before and not after, per mode context and in all contexts together; and how many covered
    lines the code change itself rewrote or removed (only with ``moved``: path -> line map, see moved_lines)."""
    lost, rewritten = [], set()

    def union(report):
        every: dict = {}
        for files in report.values():
            for path, lines in files.items():
                every.setdefault(path, set()).update(lines)
        return every

    for name, old, new in [("all", union(before), union(after))] + [
        (ctx, {p: set(v) for p, v in before[ctx].items()}, {p: set(v) for p, v in after.get(ctx, {}).items()})
        for ctx in sorted(before)
    ]:
        for path in sorted(old):
            lines = set(old[path])
            mapping = moved(path) if moved else None
            if mapping is not None:
                rewritten.update((path, line) for line in lines if line not in mapping)
                lines = {mapping[line] for line in lines if line in mapping}
            gone = sorted(lines - set(new.get(path, ())))
            if gone:
                lost.append(f"{name}: {path}: {len(gone)} line(s) no longer covered: {gone}")
    return lost, len(rewritten)


def main(argv: list[str]) -> int:
    command, *paths = argv
    if command == "install":
        print(install(Path(paths[0]).resolve()))
    elif command == "combine":
        result = combine(Path(paths[0]).resolve())
        for context, files in sorted(result.items()):
            print(f"{context}: {sum(len(lines) for lines in files.values())} lines covered in {len(files)} files")
    elif command == "compare":
        before, after = (json.loads(Path(path).read_text()) for path in paths[:2])
        lost, rewritten = compare(before, after, moved_lines(paths[2]) if len(paths) > 2 else None)
        print("\n".join(lost) or "every line covered before is covered after, in every mode")
        if len(paths) > 2:
            print(f"({rewritten} covered line(s) were rewritten or removed by the code change since {paths[2]})")
        return 1 if lost else 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.pop("SLURM_MULTI_COVERAGE", None)
    sys.exit(main(sys.argv[1:]))
