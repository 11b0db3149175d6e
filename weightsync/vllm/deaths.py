"""Why a vLLM engine died, said in the error its actor raises.

vLLM reports a dead engine as ``EngineDeadError: EngineCore encountered an issue. See stack
trace (above) for the root cause``. The stack trace and the cause (``Worker proc
VllmWorker-0 died unexpectedly (exit code: -4)``: a TP rank killed by a signal) are logged
by the engine's processes, which write to the actor's stdout and stderr. In a Ray actor those
are two files in the session's log folder::

    /tmp/ray/session_latest/logs/worker-<worker id>-<job id>-<pid>.out   (and .err)

and they reach the driver only with ``ray.init(log_to_driver=True)``, which
:func:`weightsync.tools.cluster.connect` and the tests turn off. So the engine actors add
:func:`death_note` to the error: which files, and the lines of their ends that say why (an
exit code below zero is read as the signal that killed the process)::

    except EngineDeadError as exc:
        broken = died("generate", exc)   # "the engine died during generate (...); its log: ..."
"""

from __future__ import annotations

import os
import re
import signal

#: Lines of a log that say why an engine's process ended.
_CAUSE = re.compile(
    r"died unexpectedly|exit code|Fatal Python error|Illegal instruction|Segmentation fault|"
    r"out of memory|\b\w+(Error|Exception): "
)
_EXIT_CODE = re.compile(r"exit code:? (-\d+)")
#: How much of each log's end is read, and how long a quoted line may be.
_TAIL_BYTES = 256 * 1024
_LINE_CHARS = 500


def log_files() -> list[str]:
    """The files this process's stdout and stderr write to (a Ray actor's ``.out`` and
    ``.err``); none when they are a terminal or a pipe."""
    paths: list[str] = []
    for fd in (1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if os.path.isfile(path) and path not in paths:
            paths.append(path)
    return paths


def _tail(path: str) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
            return fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _signal_of(code: int) -> str:
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return ""
    return f"exit code {code} is signal {sig.name} ({signal.strsignal(sig)})"


def death_note(paths: list[str] | None = None, lines: int = 8) -> str:
    """Where the engine's log is (``paths``, by default :func:`log_files`) and its last
    ``lines`` lines that say why a process ended (long ones cut)."""
    paths = log_files() if paths is None else paths
    if not paths:
        return "its log is this actor's stdout and stderr (not files here: see where Ray or your shell put them)"
    found = [line.strip() for path in paths for line in _tail(path) if _CAUSE.search(line)]
    # vLLM's dump of the failing step's inputs matches too, and says nothing about why.
    found = [line for line in found if "Dumping" not in line]
    unique = list(dict.fromkeys(found))[-lines:]
    note = f"its log: {' and '.join(paths)}"
    if unique:
        note += "; the lines that say why:\n    " + "\n    ".join(
            line if len(line) <= _LINE_CHARS else line[:_LINE_CHARS] + " ..." for line in unique
        )
    codes = dict.fromkeys(int(m.group(1)) for line in unique for m in _EXIT_CODE.finditer(line))
    signals = [text for text in map(_signal_of, codes) if text]
    if signals:
        note += "\n    (" + "; ".join(signals) + ")"
    return note


def died(what: str, exc: BaseException, paths: list[str] | None = None) -> str:
    """Why an engine is unusable after it died during ``what`` (or failed to ``start``), with
    :func:`death_note`."""
    return f"the engine died during {what} ({type(exc).__name__}: {exc}); {death_note(paths)}"
