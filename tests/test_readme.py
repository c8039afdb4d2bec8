"""The README stays a page a newcomer reads in minutes, and the documentation stays true.

What must hold (fast: no model is loaded, nothing is downloaded):
- README.md has at most 250 lines and names the two entry points, `make demo` and `make test`;
- CI (`.ci/run`) runs the README's test command, and the Makefile has both targets;
- every relative link in README.md and docs/*.md points to a file that exists, and a link to a
  heading (`file.md#anchor`) to a heading that exists (GitHub's anchor rules);
- every `forerun <command> --flag` in them names a real command and a real flag of it, with a
  value the flag accepts where it has a fixed set (`--dtype int8`, not `--dtype fp16`); the same
  for `python -m forerun.serve.<module>` and `scripts/*.py` (their flags read from the source).
"""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 250

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
SHELL_SEPARATORS = {"|", "||", "&&", ";", "&"}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links and inline code live there)."""
    return FENCE.sub("", text)


def _fenced(text: str, languages=("bash", "sh", "shell", "")) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang.strip() in languages]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the README's size and its two commands ------------------------------------------------------

def test_readme_is_short():
    lines = _text(README).count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, more than {MAX_README_LINES}: move detail to a page under docs/ "
        f"(dated figures to docs/results.md)")


@pytest.mark.parametrize("command", ["make demo", "make test"])
def test_readme_names_the_two_entry_points(command):
    commands = {line.split("#")[0].strip() for body in _fenced(_text(README)) for line in body.splitlines()}
    assert command in commands, f"README.md's code blocks do not run `{command}`"


def test_ci_runs_the_readmes_test_command():
    ci = [line.split("#")[0].strip() for line in _text(ROOT / ".ci" / "run").splitlines()]
    assert "make test" in ci, ".ci/run does not call `make test`, the README's test command"


def test_the_makefile_has_both_targets():
    targets = re.findall(r"^([a-z][\w-]*):", _text(ROOT / "Makefile"), re.M)
    assert {"demo", "test"} <= set(targets)


# -- links --------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores
    kept), spaces to hyphens. >>> _slug("Self-distilled data: `forerun distill`")
    'self-distilled-data-forerun-distill'"""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()  # a link keeps its words
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(_text(path)), re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_slug_follows_github():
    assert _slug("Self-distilled data: `forerun distill`") == "self-distilled-data-forerun-distill"
    assert _slug("Verify cost: Qwen2.5-Coder-1.5B") == "verify-cost-qwen25-coder-15b"
    assert _slug("Against llama.cpp, round by round") == "against-llamacpp-round-by-round"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_point_to_existing_files_and_headings(page):
    broken = []
    for target in LINK.findall(_prose(_text(page))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {_rel(dest)}")
    assert not broken, f"{_rel(page)} has broken links:\n" + "\n".join(broken)


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(_prose(_text(README)))}
    missing = [_rel(p) for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


# -- commands -----------------------------------------------------------------------------------

def _command_lines(text: str) -> list[str]:
    """Shell commands: the lines of bash blocks (continuations joined) and inline code spans that
    start with a command, whitespace and line breaks in them normalised."""
    lines = []
    for body in _fenced(text):
        lines += body.replace("\\\n", " ").splitlines()
    for span in INLINE_CODE.findall(_prose(text).replace("\n", " ")):
        if re.match(r"^(\S*/)?(forerun|python) ", span.strip()) or span.strip().startswith("PYTHONPATH="):
            lines.append(span)
    return [" ".join(line.split()) for line in lines if line.strip()]


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in a heredoc's JSON: no command there
        return []


def _invocations(line: str):
    """(program, arguments) for each forerun command, `python -m forerun.X` or `python scripts/X.py`
    in a line; arguments stop at a shell separator."""
    tokens = _tokens(line)
    for i, tok in enumerate(tokens):
        program = None
        if tok == "forerun" or tok.endswith("/forerun"):
            program, start = "forerun", i + 1
        elif tok == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("forerun."):
            program, start = tokens[i + 1], i + 2
        elif tok.startswith("scripts/") and tok.endswith(".py"):
            program, start = tok, i + 1
        if program is None:
            continue
        args = []
        for arg in tokens[start:]:
            if arg in SHELL_SEPARATORS:
                break
            args.append(arg)
        yield program, args


def _placeholder(value: str) -> bool:
    """`<llama.cpp bin>`, `$LLAMA_BIN`, `D`, `...`: a value the reader fills in."""
    return value.startswith(("<", "$", "...")) or bool(re.fullmatch(r"[A-Z]+", value))


def _forerun_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from forerun.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, dict(sub.choices)


def _source_flags(program: str) -> set[str]:
    """The flags a script or module takes: its own parser's where it has a `build_parser()` (a
    parser built from shared functions, as ray_app's from serve's), else the flags its source names."""
    path = ROOT / (program if program.endswith(".py") else program.replace(".", "/") + ".py")
    assert path.exists(), f"no {program} ({path})"
    if not program.endswith(".py") and "def build_parser(" in _text(path):
        import importlib

        return set(importlib.import_module(program).build_parser()._option_string_actions)
    return set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", _text(path))) | {"--help"}


def _check_forerun(args: list[str], top, subs) -> list[str]:
    problems = []
    if not args or args[0].startswith("<"):
        return problems
    if args[0].startswith("-"):
        return [f"{a}: not an option of forerun" for a in args if a.startswith("--") and a not in top._option_string_actions]
    command, rest = args[0], args[1:]
    if command not in subs:
        return [f"forerun {command}: no such command (there are {sorted(subs)})"]
    parser = subs[command]
    nested = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if nested is not None and rest and rest[0] in nested.choices:  # `forerun eval humaneval ...`
        command, parser, rest = f"{command} {rest[0]}", nested.choices[rest[0]], rest[1:]
    options = parser._option_string_actions
    for i, arg in enumerate(rest):
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        action = options.get(flag)
        if action is None:
            problems.append(f"forerun {command} {flag}: no such option")
            continue
        if not eq:
            value = rest[i + 1] if i + 1 < len(rest) and action.nargs != 0 else None
        if action.choices is not None and value is not None and not _placeholder(value):
            allowed = {str(c) for c in action.choices}
            if value not in allowed:
                problems.append(f"forerun {command} {flag} {value}: not one of {sorted(allowed)}")
    return problems


def test_every_documented_command_is_valid():
    top, subs = _forerun_parsers()
    problems = []
    for page in PAGES:
        for line in _command_lines(_text(page)):
            for program, args in _invocations(line):
                if program == "forerun":
                    found = _check_forerun(args, top, subs)
                else:
                    flags = _source_flags(program)
                    args = args[: args.index("--")] if "--" in args else args  # (after a bare --: another program's)
                    # (a quoted value holding spaces, `--forerun "--model m --k 4"`, is a value, not a flag)
                    found = [f"{program} {a}: no such option" for a in args
                             if a.startswith("--") and " " not in a and a.partition("=")[0] not in flags]
                problems += [f"{_rel(page)}: {p}\n    in: {line}" for p in found]
    assert not problems, "documented commands the CLI rejects:\n" + "\n".join(problems)


def test_the_command_check_catches_a_bad_flag_and_a_bad_choice():
    top, subs = _forerun_parsers()
    assert _check_forerun(["generate", "--k", "5", "--method", "ngram"], top, subs) == []
    assert _check_forerun(["generate", "--no-such-flag"], top, subs)
    assert _check_forerun(["generate", "--dtype", "fp16"], top, subs)
    assert _check_forerun(["nonsense"], top, subs)
    assert _check_forerun(["eval", "humaneval", "--limit", "3", "--method", "ngram"], top, subs) == []
    assert _check_forerun(["eval", "humaneval", "--no-such-flag"], top, subs)
    assert list(_invocations("OMP_NUM_THREADS=2 .venv/bin/forerun train --method eagle | tee log")) == [
        ("forerun", ["train", "--method", "eagle"])]
