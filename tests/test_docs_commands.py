"""Every shell command shown in README.md and docs/*.md runs as written from a fresh clone
after the README's set-up: it starts with `bash scripts/run.sh`, `.venv/bin/...` or `eval`,
names files that exist, options the command's parser takes and environment variables the
project reads; the cheap ones (`--help`) are run. The docs also stay inside the repository.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT
from weightsync.tools.cli import build_parser
from weightsync.vllm.local_server import MODULE as VLLM_SERVER

REPO = Path(ROOT)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNERS = ("bash", ".venv/bin/python", ".venv/bin/ray", "eval")
BARE = ("python", "python3", "pip", "pip3", "ray")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
#: Variables of other tools that the docs tell the user to set (read by Ray or NCCL).
OTHER_TOOLS = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "NCCL_DEBUG"}


@dataclass(frozen=True)
class Shown:
    doc: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _first_word(text: str) -> str:
    words = [w for w in text.split() if not ASSIGNMENT.match(w)]
    return words[0] if words else ""


def _is_command(text: str, inline: bool) -> bool:
    if len(text.split()) < 2:  # `python`, `.venv/bin/python`: names a program, runs nothing
        return False
    first = _first_word(text)
    if first in RUNNERS or first.startswith(".venv/bin/"):
        return True
    # Inline, `ray ...` names Ray's own CLI on some other machine's head (`ray stop`, ...);
    # a command the reader runs here is written with a runner, or with a variable before it.
    if first not in BARE:
        return False
    return not inline or first != "ray" or bool(ASSIGNMENT.match(text))


def shown_commands(doc: Path) -> list[Shown]:
    """The commands in ``doc``: lines of code blocks (fenced, not Python; or indented) and
    inline code spans that start like a command; ``\\`` continuations joined, comments cut."""
    name = doc.relative_to(REPO).as_posix()
    lines = doc.read_text().splitlines()
    found: list[Shown] = []
    prose: list[str] = []
    fence: str | None = None
    pending = ""
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
            prose.append("")
            continue
        indented = (
            fence is None and line.startswith("    ") and (bool(pending) or not stripped.startswith(("-", "|", "*")))
        )
        if (fence is not None and fence != "python") or indented:
            text = (pending + " " + stripped).strip() if pending else stripped
            if text.endswith("\\"):
                pending = text[:-1]
                continue
            pending = ""
            text = re.sub(r"\s+#\s.*$", "", text).strip()
            if _is_command(text, inline=False):
                found.append(Shown(name, number, text))
            prose.append("")
            continue
        prose.append("" if fence else line)
    text = "\n".join(prose)
    for match in re.finditer(r"`([^`]+)`", text):
        span = " ".join(match.group(1).split())
        if _is_command(span, inline=True):
            found.append(Shown(name, text.count("\n", 0, match.start()) + 1, span))
    return found


ALL = [shown for doc in DOCS for shown in shown_commands(doc)]


@functools.cache
def code_text() -> str:
    # Caches next to the sources (numba's compiled loops, bytecode) are not code to read.
    files = [p for d in ("weightsync", "scripts", "examples") for p in (REPO / d).rglob("*.*")]
    parts = [p.read_text() for p in files if "__pycache__" not in p.parts]
    return "\n".join(p for p in parts if p)


@functools.cache
def run_sh_commands() -> set[str]:
    case = re.search(r"^\s*([a-z|]+)\) shift ;;", (REPO / "scripts" / "run.sh").read_text(), re.M)
    assert case, "scripts/run.sh: no `demo|test|...) shift ;;` line"
    return set(case.group(1).split("|"))


def check_path(word: str, shown: Shown) -> None:
    path = word.split("::", 1)[0]
    if "/" in path and path.split("/", 1)[0] in {"scripts", "examples", "tests", "docs", "docker", "weightsync"}:
        assert list(REPO.glob(path)), f"{shown}: {path} does not exist"


@functools.cache
def tracked_files() -> frozenset[str]:
    """The repository's tracked files (git's list; without git, every file under docs/)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return frozenset(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*") if p.is_file())
    return frozenset(listed.stdout.splitlines())


def check_weightsync_args(args: list[str], shown: Shown) -> None:
    """Parsed by the CLI's own parser: an unknown option or a bad value fails here; so does
    an output file (``--plot``, ``--json``) that would overwrite a tracked one."""
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as exc:
        assert exc.code == 0 and "--help" in args, f"{shown}: `weightsync {' '.join(args)}` is refused by its parser"
        return
    for option in ("plot", "json"):
        out = getattr(parsed, option, None)
        assert not (out and os.path.normpath(out) in tracked_files()), f"{shown}: --{option} overwrites tracked {out}"


def check_script(path: str, args: list[str], shown: Shown) -> None:
    check_path(path, shown)
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--") and a != "--"]
    if not flags:
        return
    source = (REPO / path).read_text()
    assert "argparse" in source, f"{shown}: {path} takes no options"
    for flag in flags:
        if flag != "--help":
            assert f'"{flag}"' in source, f"{shown}: {path} has no option {flag}"


def check_entrypoint(words: list[str], shown: Shown) -> None:
    """The command a job runs (after `--`): on the head, `python` is the venv's."""
    if words[:3] == ["python", "-m", "weightsync"]:
        check_weightsync_args(words[3:], shown)
    elif words and words[0] not in ("...", "…", "true"):
        check_path(words[-1], shown)


def check(words: list[str], shown: Shown) -> None:
    while words and ASSIGNMENT.match(words[0]):
        variable = words.pop(0).split("=", 1)[0]
        assert variable in code_text() or variable in OTHER_TOOLS, f"{shown}: nothing reads {variable}"
    assert words, f"{shown}: only variables"
    first, rest = words[0], words[1:]
    assert first not in BARE, f"{shown}: `{first}` is not the project's; write .venv/bin/{first} or scripts/run.sh"
    if first == "eval":
        inner = re.fullmatch(r'"?\$\((.*)\)"?', " ".join(rest))
        assert inner, f"{shown}: eval of something other than $(...)"
        check(shlex.split(inner.group(1)), shown)
    elif first == "bash":
        assert rest and rest[0] == "scripts/run.sh", f"{shown}: bash runs only scripts/run.sh"
        assert rest[1:2] and rest[1] in run_sh_commands(), f"{shown}: scripts/run.sh has no command {rest[1:2]}"
        sub, args = rest[1], rest[2:]
        if sub in ("demo", "cluster"):
            entry = args.index("--") if "--" in args else len(args)
            check_weightsync_args([sub, *args[: entry + 1]], shown)
            check_entrypoint(args[entry + 1 :], shown)
        elif sub == "test":
            for arg in args:
                check_path(arg, shown)
    elif first == ".venv/bin/python":
        if rest[:2] == ["-m", "weightsync"]:
            entry = rest.index("--") if "--" in rest else len(rest)
            check_weightsync_args(rest[2 : entry + 1], shown)
            check_entrypoint(rest[entry + 1 :], shown)
        elif rest[:3] == ["-m", "pip", "install"]:
            table = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1]
            extras = re.findall(r"^([a-z0-9_]+) = \[", table.split("\n[", 1)[0], re.M)
            for word in rest[3:]:
                for extra in re.findall(r"\.\[([a-z0-9_,]+)\]", word):
                    assert set(extra.split(",")) <= set(extras), f"{shown}: no extra {extra} in pyproject.toml"
        elif rest[:2] == ["-m", "pytest"]:
            for arg in rest[2:]:
                check_path(arg, shown)
        elif rest[:2] == ["-m", VLLM_SERVER]:
            for option in ("--model", "--weight-transfer-config"):
                assert option in rest, f"{shown}: a vLLM server for weightsync needs {option}"
        else:
            check_script(rest[0], rest[1:], shown)
    elif first == ".venv/bin/ray":
        entry = rest.index("--") if "--" in rest else len(rest)
        check_entrypoint(rest[entry + 1 :], shown)
    else:
        raise AssertionError(f"{shown}: runs {first}; write it with scripts/run.sh or .venv/bin/")


def test_the_docs_show_commands() -> None:
    assert len(ALL) > 40 and any("run.sh demo" in s.text for s in ALL) and any(s.doc != "README.md" for s in ALL)


@pytest.mark.parametrize("shown", ALL, ids=[f"{s.doc}:{s.line}" for s in ALL])
def test_each_command_runs_as_written(shown: Shown) -> None:
    text = shown.text.replace("…", "...")
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise AssertionError(f"{shown}: not a shell command ({exc})") from None
    check(words, shown)


# `weightsync <command> --help` is parsed in process above; the program itself and the scripts
# run here.
HELP = sorted(
    {
        s.text
        for s in ALL
        if s.text.startswith(".venv/bin/python ")
        and s.text.endswith(" --help")
        and not s.text.startswith(".venv/bin/python -m weightsync ")
    }
    | {".venv/bin/python -m weightsync --help"}
)


@pytest.mark.parametrize("command", HELP)
def test_help_commands_run(command: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    args = shlex.split(command)[1:]
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, f"{command}: {proc.stdout[-1000:]}{proc.stderr[-2000:]}"


def test_a_bare_interpreter_or_a_missing_file_or_option_is_caught() -> None:
    bad = [
        "python -m weightsync doctor",
        "bash scripts/run.sh demo --wrkers 2",
        ".venv/bin/python examples/nope.py",
        ".venv/bin/python -m weightsync bench --sizes 3tb",
        'eval "$(bash scripts/run.sh clutser env)"',
        "WEIGHTSYNC_NOTHING=1 bash scripts/run.sh test",
        '.venv/bin/python -m pip install -e ".[nothing]"',
        ".venv/bin/python scripts/sync_timeline.py --no-such-flag",
        ".venv/bin/python -m weightsync bench --sizes 1mb --quick --plot docs/bench-cpu.svg",
        ".venv/bin/python -m weightsync demo --json README.md",
        ".venv/bin/python -m vllm.entrypoints.openai.api_server --model DIR",
    ]
    for text in bad:
        with pytest.raises((AssertionError, SystemExit)):
            check(shlex.split(text), Shown("x.md", 1, text))


def test_the_docs_stand_alone() -> None:
    """No links to files outside the repository, no notes about how the work was organised."""
    for doc in DOCS:
        text = doc.read_text()
        for pattern in (r"\.\./shared", r"\bissue[- ]\d+", r"\bbranch ws\d*", r"\bthe lead\b", r"\bagents?\b"):
            hit = re.search(pattern, text, re.I)
            assert not hit, f"{doc.name}: {hit.group(0)!r} at line {text.count(chr(10), 0, hit.start()) + 1}"
        for link in re.findall(r"\]\(([^)#]+)", text):
            if not link.startswith(("http://", "https://")):
                assert (doc.parent / link).resolve().is_relative_to(REPO), f"{doc.name}: link {link} leaves the repo"
                assert (doc.parent / link).exists(), f"{doc.name}: link {link} does not exist"


def test_configuration_lists_every_environment_variable_the_project_reads() -> None:
    table = (REPO / "docs" / "configuration.md").read_text().split("## Environment", 1)[1]
    read = set(re.findall(r"environ(?:\.get)?\(\s*\"([A-Z_][A-Z0-9_]*)\"", code_text()))
    read |= set(re.findall(r"environ\[\"([A-Z_][A-Z0-9_]*)\"\]", code_text()))
    read |= set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (REPO / "scripts" / "run.sh").read_text()))
    assert {"RAY_ADDRESS", "WEIGHTSYNC_HEAD_DIR", "WEIGHTSYNC_VLLM", "PYTHON"} <= read
    missing = sorted(v for v in read if f"`{v}" not in table)
    assert not missing, f"docs/configuration.md's environment table lacks {missing}"


def readme_python_blocks() -> list[Shown]:
    """Every ```python block of README.md, with the line it starts on."""
    blocks, current, start = [], None, 0
    for number, line in enumerate((REPO / "README.md").read_text().splitlines(), 1):
        if current is None and line.strip() == "```python":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append(Shown("README.md", start, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


PYTHON = readme_python_blocks()


def test_the_readme_shows_python_examples() -> None:
    assert len(PYTHON) >= 4 and any("VLLMWorker" in block.text for block in PYTHON)


@pytest.mark.parametrize("block", PYTHON, ids=[f"README.md:{b.line}" for b in PYTHON])
def test_each_readme_example_binds_every_name_and_imports_what_exists(block: Shown) -> None:
    """As written, each block runs on its own from the repository root: every name it uses is
    bound in it (ruff's undefined-name check) and everything it imports exists."""
    compile(block.text, str(block), "exec")
    lint = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "F821,F822",
            "--stdin-filename",
            "readme_example.py",
            "-",
        ],
        cwd=REPO,
        input=block.text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, f"{block}: names used but never bound:\n{lint.stdout}"
    for node in ast.walk(ast.parse(block.text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name) is not None, f"{block}: no module {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert importlib.util.find_spec(node.module) is not None, f"{block}: no module {node.module}"
            if node.module.split(".")[0] in ("weightsync", "examples"):  # vLLM's names: its own import
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                        f"{block}: {node.module} has no {alias.name}"
                    )


def test_the_readme_porting_example_runs_as_written() -> None:
    (block,) = [b for b in PYTHON if "packed_nccl_broadcast_producer" in b.text]
    env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-c", block.text], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{block}:\n{proc.stderr[-2000:]}"
