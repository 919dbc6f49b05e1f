"""The tree stays easy to take in: a folder of Python holds at most MAX_FILES files, a module_utils file at most
MAX_LINES lines (issue 56; split by idea, beside its code, when either grows past it)."""

import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 15
MAX_LINES = 600


def _python_files():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [Path(name) for name in listed if (ROOT / name).is_file()]


def test_no_folder_holds_more_than_fifteen_python_files():
    crowded = {
        str(folder): count
        for folder, count in Counter(path.parent for path in _python_files()).items()
        if count > MAX_FILES
    }
    assert crowded == {}, "split these folders by idea"


def test_no_module_utils_file_is_longer_than_six_hundred_lines():
    long = {
        str(path): lines
        for path in _python_files()
        if path.parts[0] == "module_utils"
        for lines in [len((ROOT / path).read_text().splitlines())]
        if lines > MAX_LINES
    }
    assert long == {}
