"""module_utils imports one way: each part imports only the parts below it (docs/extending.md, "Layers").

Read from the source (every import statement, function-local ones included), so a new import that climbs a layer
fails here before anyone runs it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "ansible_collections.slurm_multi.pipeline.plugins.module_utils"
# From the bottom. A part is a subpackage of module_utils or one of its top-level files; parts in one layer import
# none of each other.
LAYERS = (
    ("user_error",),
    ("safe_files",),
    ("docker_api",),
    ("docker_cli",),
    ("slurm",),
    ("job",),
    ("gpu", "image", "barrier"),
    ("node",),
    ("run",),
    ("runtimes",),
    ("results",),
    ("module_runner",),
)
LAYER_OF = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def _part(path: Path) -> str:
    relative = path.relative_to(ROOT / "module_utils")
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imported_parts(path: Path) -> set:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.startswith(PACKAGE + "."):
                parts.add(name[len(PACKAGE) + 1 :].split(".")[0])
    return parts


def _imports() -> list:
    """(importing part, imported part, file) for every import between two different parts."""
    found = []
    for path in sorted((ROOT / "module_utils").rglob("*.py")):
        part = _part(path)
        found += [(part, other, path) for other in _imported_parts(path) - {part, "__init__"}]
    return found


def test_every_part_of_module_utils_has_a_layer():
    parts = {_part(path) for path in (ROOT / "module_utils").rglob("*.py")} - {"__init__"}
    assert parts - set(LAYER_OF) == set(), "give each new part of module_utils its layer in LAYERS"


def test_each_part_imports_only_the_layers_below_it():
    climbing = [
        f"{path.relative_to(ROOT)}: {part} imports {other}"
        for part, other, path in _imports()
        if LAYER_OF.get(other, -1) >= LAYER_OF.get(part, -1)
    ]
    assert climbing == [], "move what both need down to the lower part:\n" + "\n".join(climbing)


def test_no_two_parts_import_each_other():
    pairs = {(part, other) for part, other, _ in _imports()}
    assert {tuple(sorted(pair)) for pair in pairs if pair[::-1] in pairs} == set()
