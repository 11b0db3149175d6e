"""``bench --plot``: the chart of a small bench result names every case and its size, marks
each case's limit, and a path that cannot be written is refused before anything runs."""

from __future__ import annotations

import argparse
import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from weightsync.core.wire.errors import SettingsError
from weightsync.tools import cluster
from weightsync.tools.bench.chart import check_plot_path, plot
from weightsync.tools.bench.report import Case
from weightsync.tools.cli import build_parser

SVG = "{http://www.w3.org/2000/svg}"


def small_result() -> list[Case]:
    """What a ``--sizes 1mb,100mb --transports direct,broadcast`` run records, with made-up times."""
    cases = []
    for size, nbytes, scale in (("1mb", 1_048_576, 0.01), ("100mb", 104_857_600, 1.0)):
        copy, raw = 0.012 * scale, 0.065 * scale
        cases += [
            Case(size, "raw limit: one copy of one buffer", nbytes, times=[copy] * 2, limit_s=copy),
            Case(size, "ray floor: one no-op call per side", nbytes, times=[0.0014, 0.0015]),
            Case(size, "weightsync direct", nbytes, 16.0, 2, times=[0.015 * scale, 0.016 * scale], limit_s=copy),
            Case(size, "raw limit: one gloo broadcast, 2 recv", nbytes, times=[raw] * 3, limit_s=raw),
            Case(size, "weightsync broadcast, 2 receiver(s)", nbytes, 16.0, 2, times=[0.08 * scale], limit_s=raw),
            Case(size, "weightsync broadcast (knobs)", nbytes, 64.0, 2, times=[0.09 * scale], limit_s=raw),
            Case(size, "naive: one gloo broadcast per tensor", nbytes, times=[0.14 * scale], limit_s=raw),
        ]
    return cases


def test_svg_chart_names_every_case_per_size_and_marks_its_limit(tmp_path: Path) -> None:
    cases = small_result()
    path = tmp_path / "bench.svg"
    check_plot_path(str(path))
    plot(cases, str(path))
    root = ET.parse(path).getroot()
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    headings = [t for t in texts if t.startswith(("1mb (", "100mb ("))]
    assert headings == ["1mb (0.00105 GB)", "100mb (0.105 GB)"], headings
    for case in cases:
        shown = sum(t.startswith(case.name) for t in texts)
        expected = 0 if case.name.startswith("ray floor") else 2  # once per size; a no-op's GB/s means nothing
        assert shown == expected, f"{case.name}: drawn {shown} times, expected {expected}"
    assert any(t.startswith("weightsync broadcast (knobs) (64 MiB x 2)") for t in texts)
    # A bar per drawn case; a limit tick on every case measured against a limit that is not one itself.
    bars = list(root.iter(f"{SVG}rect"))
    drawn = [c for c in cases if not c.name.startswith("ray floor")]
    assert len(bars) == 1 + len(drawn) + 2  # the background, the bars, the legend's two swatches
    notes = [t for t in texts if "GB/s" in t and "of limit" in t]
    assert len(notes) == sum(not c.name.startswith("raw limit") for c in drawn)
    # 100mb direct: 12 ms copy against a 15.5 ms median.
    assert any(t.endswith(f"{0.012 / 0.0155:.0%} of limit") for t in notes), notes


def test_a_plot_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="--plot") as missing:
        check_plot_path(str(tmp_path / "no-such-folder" / "bench.svg"))
    assert "no-such-folder" in str(missing.value)
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(SettingsError, match=r"--plot .*bench\.png") as png:
            check_plot_path(str(tmp_path / "bench.png"))
        assert ".svg" in str(png.value) and "plot extra" in str(png.value)
    else:
        plot(small_result(), str(tmp_path / "bench.png"))
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_results_file_that_cannot_be_written_is_refused_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bench began (connected to Ray) with a --json path it cannot write")

    monkeypatch.setattr(cluster, "connect", no_measuring)
    missing = str(tmp_path / "no-such-folder" / "bench.json")
    args = build_parser().parse_args(["bench", "--sizes", "1mb", "--json", missing])
    with pytest.raises(SettingsError, match="--json") as err:
        args.func(args)
    assert "no-such-folder" in str(err.value)


def test_the_bench_takes_a_plot_path() -> None:
    args = build_parser().parse_args(["bench", "--sizes", "1mb", "--plot", "bench.svg"])
    assert args.plot == "bench.svg"


def test_a_case_weightsync_refuses_is_skipped_and_any_other_setup_failure_fails_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from weightsync.core.wire import SetupError
    from weightsync.core.wire.outcome import Outcome, Status
    from weightsync.tools.bench.driver import Bench

    bench = Bench(argparse.Namespace(timeout_s=5.0))
    refusal = Outcome(party="w0", phase="setup", status=Status.FAILED, error="ManifestError", message="dtype")
    bench.not_run("1mb", "direct", SetupError("w0 refused", {"w0": refusal}, ["w0"]))
    frozen = Outcome(party="w1", phase="setup", status=Status.TIMED_OUT, error="", message="no answer")
    bench.not_run("1mb", "ipc", SetupError("w1 timed out", {"w1": frozen}, ["w1"]))
    bench.not_run("1mb", "broadcast", RuntimeError("gloo could not bind"))
    lines = capsys.readouterr().out.splitlines()
    assert "skipped: SetupError: w0 refused" in lines[0]
    assert "FAILED: SetupError: w1 timed out" in lines[1]
    assert "FAILED: RuntimeError: gloo could not bind" in lines[2]
    assert bench.failed == ["1mb ipc", "1mb broadcast"]
