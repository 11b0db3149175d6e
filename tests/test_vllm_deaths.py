"""An engine actor's error says why its engine died: where the log is and the lines that say why."""

from __future__ import annotations

import signal
from pathlib import Path

from weightsync.vllm.deaths import death_note, died

# What a Ray actor's .out file holds when vLLM's TP rank died by SIGILL (lines as logged).
OUT = """\
(EngineCore pid=7474) INFO 12-05 17:52:41 [compilation.py:317] Enabled custom fusions: norm_quant, act_quant
(EngineCore pid=7474) ERROR 12-05 17:52:41 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.
(EngineCore pid=7474) ERROR 12-05 17:52:41 [dump_input.py:72] Dumping input data for V1 LLM engine (v0.32.0) with config: model='/tmp/x' RuntimeError: {"x": 1}
(EngineCore pid=7474) ERROR 12-05 17:52:41 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=7474) ERROR 12-05 17:52:41 [core.py:1512] RuntimeError: cancelled
(MainProcess pid=5659) INFO 12-05 17:52:41 [core_client.py:777] [shutdown] MPClient: complete
"""


def test_the_note_names_the_log_and_quotes_why_with_the_signal(tmp_path: Path) -> None:
    out, err = tmp_path / "worker-1-01-5659.out", tmp_path / "worker-1-01-5659.err"
    # Only the end of a long log is read; a long line is cut.
    out.write_text("x" * 300_000 + "\n" + OUT + "ValueError: " + "z" * 2000 + "\n")
    err.write_text("Fatal Python error: Illegal instruction\n" + "y" * 1000 + "\n")
    note = death_note([str(out), str(err)])
    assert f"its log: {out} and {err}" in note
    assert "Worker proc VllmWorker-0 died unexpectedly (exit code: -4)" in note
    assert "RuntimeError: cancelled" in note and "Fatal Python error: Illegal instruction" in note
    assert "Dumping" not in note and "Enabled custom fusions" not in note and "MPClient" not in note
    assert f"exit code -4 is signal SIGILL ({signal.strsignal(signal.SIGILL)})" in note
    assert max(len(line) for line in note.splitlines()) < 600  # long lines are cut


def test_an_actor_error_says_what_died_and_a_process_without_log_files_says_so(tmp_path: Path) -> None:
    log = tmp_path / "w.out"
    log.write_text("Worker proc VllmWorker-1 died unexpectedly (exit code: 17)\n")
    text = died("generate", RuntimeError("EngineCore encountered an issue"), [str(log)])
    assert text.startswith("the engine died during generate (RuntimeError: EngineCore encountered an issue)")
    assert str(log) in text and "exit code: 17" in text and "signal" not in text
    assert "not files here" in death_note([])
