"""argparse value types shared by the subcommands (demo, bench).

A type that raises ``argparse.ArgumentTypeError`` makes argparse exit with status 2 and a
message that names the option (``argument --steps: must be at least 1, got 0``), so each
check lives here once instead of after parsing in every command.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

from weightsync.core.wire.settings import DEFAULT_ALIGNMENT, MIB

#: What ``add_subparsers`` returns, for functions that add a subcommand (argparse names its
#: class privately).
Subparsers = argparse._SubParsersAction


def positive_int(value: str) -> int:
    """A whole number of at least 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _finite_positive(value: str, expected: str) -> float:
    """``value`` as a finite number above 0; ``expected`` says what it is (in the refusal)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    if not (number > 0 and math.isfinite(number)):
        raise argparse.ArgumentTypeError(f"expected {expected}, finite and above 0, got {value}")
    return number


def mib_as_bytes(value: str) -> int:
    """A size in MiB (fractions allowed), returned in bytes: finite, above 0, and a whole
    number of the buffers' alignment (256 bytes), as buffer sizes must be."""
    nbytes = round(_finite_positive(value, "a size in MiB") * MIB)
    if nbytes == 0 or nbytes % DEFAULT_ALIGNMENT:
        raise argparse.ArgumentTypeError(
            f"{value} MiB is {nbytes} bytes, not a whole number of {DEFAULT_ALIGNMENT}-byte blocks "
            f"(multiples of {DEFAULT_ALIGNMENT / MIB:g} MiB, e.g. 0.25, 1 or 64)"
        )
    return nbytes


def positive_seconds(value: str) -> float:
    """A finite number of seconds above 0."""
    return _finite_positive(value, "a number of seconds")


def comma_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``allowed`` (an unknown name is refused by name)."""

    def parse(value: str) -> list[str]:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from {','.join(allowed)}"
            )
        if not names:
            raise argparse.ArgumentTypeError(f"expected at least one of {','.join(allowed)}")
        return names

    return parse


def positive_int_list(value: str) -> list[int]:
    """Comma-separated whole numbers, each at least 1."""
    return [positive_int(part) for part in value.split(",")]


def positive_int_list_or_none(value: str) -> list[int]:
    """``none`` (an empty list: the cases are off) or comma-separated whole numbers, each at least 1."""
    return [] if value.strip().lower() == "none" else positive_int_list(value)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default
    or there is nothing to say (no default, or a flag that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "default" in help_text or action.default in (None, False, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action)
