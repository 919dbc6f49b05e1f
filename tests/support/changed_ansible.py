"""A stand-in for an ansible-core release that renamed a private module the speed-up layer imports: a copy of the
installed ansible package whose `ansible._internal._templating._jinja_bits` is `_jinja_parts`, renamed everywhere
ansible-core itself imports it, so that Ansible works and only the layer's import fails. Put first on PYTHONPATH, it
is the `ansible` that ansible-playbook imports."""

import shutil
from pathlib import Path

import ansible

RENAMED = "ansible._internal._templating._jinja_bits"
RENAMED_TO = "_jinja_parts"


def changed_ansible(where: Path) -> Path:
    """The stand-in's dir in ``where`` (made readable by every user), for PYTHONPATH."""
    package = where / "ansible"
    shutil.copytree(Path(ansible.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    old_name = RENAMED.rsplit(".", 1)[1]
    (package / "_internal" / "_templating" / f"{old_name}.py").rename(
        package / "_internal" / "_templating" / f"{RENAMED_TO}.py"
    )
    for source in package.rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        if old_name in text:
            source.write_text(text.replace(old_name, RENAMED_TO), encoding="utf-8")
    for path in [where, *where.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return where
