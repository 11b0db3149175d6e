"""``--help`` explains every option of every subcommand, with its default."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from weightsync.tools.cli import build_parser


def parsers(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser under ``parser`` (itself first), with its command path (``cluster submit``)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}".strip())


ALL = list(parsers(build_parser()))


def test_every_subcommand_is_walked() -> None:
    names = {path for path, _ in ALL}
    assert {"demo", "bench", "doctor", "cluster", "cluster start", "cluster submit", "cluster stop"} <= names


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[path or "top" for path, _ in ALL])
def test_every_option_has_help_and_shows_its_default(path: str, parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"`{path} {name}` has no help text"
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            # The option's entry in --help, as the parser's own formatter writes it.
            entry = parser._get_formatter()._format_action(action)
            assert "default" in entry, f"`{path} {name}` does not show its default ({action.default!r}): {entry}"


def test_top_level_help_is_plain_text_naming_every_command() -> None:
    text = build_parser().format_help()
    assert "``" not in text and ":mod:" not in text
    for command in ("demo", "bench", "doctor", "cluster"):
        assert command in text
