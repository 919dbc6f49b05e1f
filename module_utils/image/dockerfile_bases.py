"""The images a Dockerfile builds on: its FROM lines once the build args are substituted, as Docker does (only an
`ARG` before the first `FROM` is in scope); their IDs count in the build fingerprint (image/build.py)."""

from __future__ import annotations

import re
from collections import namedtuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

BaseImages = namedtuple("BaseImages", "references run_image_base arguments")
BaseImages.__doc__ = """A Dockerfile's base images: every image its FROM lines name (in order, once), the one the last
stage builds on ("" for scratch), and the ARGs before the first FROM as the FROM lines see them."""

_DIRECTIVE = re.compile(r"^#\s*([A-Za-z]+)\s*=\s*(\S*)\s*$")
_HEREDOC = re.compile(r"<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEREDOC_INSTRUCTIONS = ("RUN", "COPY", "ADD")
SCRATCH = "scratch"
MAD_BASE_ARG = "BASE_DOCKER"


class DockerfileBaseError(UserError):
    """A FROM line whose image cannot be told from the Dockerfile and the build args."""


def _escape_character(lines: list) -> tuple:
    """(the escape character, the index of the first line after the parser directives)."""
    escape = "\\"
    for index, line in enumerate(lines):
        match = _DIRECTIVE.match(line.strip())
        if not match:
            return escape, index
        if match.group(1).lower() == "escape" and match.group(2) in ("\\", "`"):
            escape = match.group(2)
    return escape, len(lines)


def _split_instruction(line: str) -> tuple:
    """(KEYWORD, arguments) of one whole instruction."""
    parts = line.split(None, 1)
    return parts[0].upper(), (parts[1].strip() if len(parts) > 1 else "")


def instructions(text: str, heredocs_allowed: bool = True) -> tuple:
    """(escape character, [(KEYWORD, arguments)]): the Dockerfile's instructions, continuation lines joined. A
    `<<WORD` whose WORD line never comes was no heredoc: the text is read again without heredocs."""
    lines = text.splitlines()
    escape, start = _escape_character(lines)
    found, current, heredocs = [], None, []
    for line in lines[start:]:
        if heredocs:
            strip_tabs, word = heredocs[0]
            if (line.lstrip("\t") if strip_tabs else line) == word:
                heredocs.pop(0)
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # blank and comment lines, also inside a continued instruction
        body = line.rstrip()
        continued = body.endswith(escape)
        body = body[:-1] if continued else body
        current = body if current is None else current + body
        if continued:
            continue
        keyword, arguments = _split_instruction(current)
        found.append((keyword, arguments))
        current = None
        if heredocs_allowed and keyword in _HEREDOC_INSTRUCTIONS:
            heredocs = [(match.group(1) == "-", match.group(3)) for match in _HEREDOC.finditer(arguments)]
    if heredocs:
        return instructions(text, heredocs_allowed=False)
    if current is not None and current.strip():
        found.append(_split_instruction(current))
    return escape, found


def _closing_brace(word: str, start: int) -> int:
    """The index of the `}` closing a `${` whose name starts at `start` (a default may hold `${...}` itself); -1."""
    depth = 1
    for index in range(start, len(word)):
        if word.startswith("${", index):
            depth += 1
        elif word[index] == "}":
            depth -= 1
            if depth == 0:
                return index
    return -1


def _variable(word: str, at: int, variables: dict, escape: str, where: str) -> tuple:
    """(the value, the index after it) of the `$...` at `word[at]`."""
    if word.startswith("${", at):
        end = _closing_brace(word, at + 2)
        if end < 0:
            raise DockerfileBaseError(f"{where}: `${{` without its `}}` in {word!r}")
        inner = word[at + 2 : end]
        match = _NAME.match(inner)
        if not match:
            raise DockerfileBaseError(f"{where}: {word[at : end + 1]!r} names no variable")
        name, modifier = match.group(0), inner[match.end() :]
        value = variables.get(name)
        if modifier == "":
            return value or "", end + 1
        if modifier.startswith(":-"):
            return value or expand(modifier[2:], variables, escape, where), end + 1
        if modifier.startswith(":+"):
            return (expand(modifier[2:], variables, escape, where) if value else ""), end + 1
        raise DockerfileBaseError(
            f"{where}: {word[at : end + 1]!r} uses a substitution this reading of Dockerfiles does not know (it "
            "knows ${NAME}, ${NAME:-default} and ${NAME:+alternative}); name the base image with one of those"
        )
    match = _NAME.match(word, at + 1)
    if not match:
        return "$", at + 1
    return variables.get(match.group(0)) or "", match.end()


def expand(word: str, variables: dict, escape: str = "\\", where: str = "Dockerfile") -> str:
    """`word` with its variables substituted and its quotes removed, as Docker processes an ARG or FROM word."""
    out, at, quote = [], 0, None
    while at < len(word):
        char = word[at]
        if quote == "'":
            if char == "'":
                quote = None
            else:
                out.append(char)
            at += 1
        elif char == escape and at + 1 < len(word):
            out.append(word[at + 1])
            at += 2
        elif char in "'\"" and quote is None:
            quote = char
            at += 1
        elif char == '"' and quote == '"':
            quote = None
            at += 1
        elif char == "$":
            value, at = _variable(word, at, variables, escape, where)
            out.append(value)
        else:
            out.append(char)
            at += 1
    return "".join(out)


def _declare_arguments(arguments: str, variables: dict, build_args: dict, escape: str, where: str) -> None:
    for declaration in arguments.split():
        name, equals, default = declaration.partition("=")
        if name in build_args:
            variables[name] = str(build_args[name])  # a build arg's value is taken as given, never substituted
        elif equals:
            variables[name] = expand(default, variables, escape, where)
        else:
            variables.pop(name, None)


def read_base_images(text: str, build_args=None, source: str = "Dockerfile") -> BaseImages:
    """The base images of the Dockerfile `text` under `build_args`; DockerfileBaseError when a FROM line names no
    image once substituted, or uses a substitution this reading does not know."""
    build_args = build_args or {}
    escape, found = instructions(text)
    variables, stage_bases, references = {}, {}, []
    run_image_base, seen_from = "", False
    for number, (keyword, arguments) in enumerate(found, start=1):
        where = f"{source}, instruction {number} ({keyword})"
        if keyword == "ARG" and not seen_from:
            _declare_arguments(arguments, variables, build_args, escape, where)
            continue
        if keyword != "FROM":
            continue
        seen_from = True
        words = [word for word in arguments.split() if not word.startswith("--")]
        if not words:
            raise DockerfileBaseError(f"{where}: FROM names no image")
        image = expand(words[0], variables, escape, where)
        if not image:
            raise DockerfileBaseError(
                f"{where}: FROM {words[0]} names no image: give its ARG a value (a default in the Dockerfile, or "
                "the run context's docker_build_arg, e.g. BASE_DOCKER)"
            )
        if image.lower() in stage_bases:
            base = stage_bases[image.lower()]
        elif image == SCRATCH:
            base = ""
        else:
            base = image
            if image not in references:
                references.append(image)
        if len(words) >= 3 and words[1].lower() == "as":
            stage_bases[words[2].lower()] = base
        run_image_base = base
    return BaseImages(references, run_image_base, variables)


def dockerfile_base_images(dockerfile_path, build_args=None) -> BaseImages:
    """`read_base_images` of the Dockerfile at `dockerfile_path`."""
    try:
        with open(dockerfile_path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as error:
        raise DockerfileBaseError(f"cannot read Dockerfile {dockerfile_path}: {error.strerror}") from None
    return read_base_images(text, build_args, str(dockerfile_path))


def base_docker(bases: BaseImages, build_args=None) -> str:
    """The record's `base_docker`, as madengine fills it: the `BASE_DOCKER` build arg, else the Dockerfile's
    `ARG BASE_DOCKER` default; where neither is set, the run image's base ("" for scratch)."""
    given = (build_args or {}).get(MAD_BASE_ARG)
    return str(given) if given else bases.arguments.get(MAD_BASE_ARG) or bases.run_image_base
