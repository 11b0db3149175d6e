"""Bad command-line values are refused before anything starts, naming the option."""

from __future__ import annotations

import pytest

from weightsync.tools.cli import build_parser


@pytest.mark.parametrize(
    ("argv", "option", "shown"),
    [
        (["demo", "--steps", "0"], "--steps", "0"),
        (["demo", "--steps", "-1"], "--steps", "-1"),
        (["demo", "--steps", "two"], "--steps", "two"),
        (["demo", "--workers", "0"], "--workers", "0"),
        (["demo", "--num-buffers", "0"], "--num-buffers", "0"),
        (["demo", "--buffer-mib", "0"], "--buffer-mib", "0"),
        (["bench", "--repeats", "0"], "--repeats", "0"),
        (["bench", "--transports", "ipc,nccl-fast"], "--transports", "nccl-fast"),
        (["bench", "--transports", ","], "--transports", "at least one"),
        (["bench", "--sizes", "1mb,3tb"], "--sizes", "3tb"),
        (["bench", "--buffer-mib", "256,0"], "--buffer-mib", "0"),
        (["bench", "--sharded-ranks", "2,0"], "--sharded-ranks", "0"),
        (["bench", "--sharded-ranks", "two"], "--sharded-ranks", "two"),
    ],
)
def test_bad_values_exit_2_with_a_message_naming_the_option(
    argv: list[str], option: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err
    assert shown in err.split(f"argument {option}", 1)[1]  # and the refused value


def test_an_unknown_bench_transport_is_named_among_good_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--transports", "ipc,nccl-fast,direct"])
    err = capsys.readouterr().err
    assert "'nccl-fast'" in err and "'ipc'" not in err


def test_good_values_parse() -> None:
    args = build_parser().parse_args(["demo", "--steps", "1", "--workers", "3", "--buffer-mib", "0.5"])
    assert (args.steps, args.workers, args.buffer_mib) == (1, 3, 512 * 1024)
    bench = build_parser().parse_args(["bench", "--repeats", "2", "--transports", "ipc,direct", "--sizes", "1mb"])
    assert (bench.repeats, bench.transports, bench.sizes) == (2, ["ipc", "direct"], ["1mb"])
    assert bench.sharded_ranks is None  # the run picks its default (CPU: 2 ranks)
    ranks = build_parser().parse_args(["bench", "--sharded-ranks", "2,3"]).sharded_ranks
    assert (ranks, build_parser().parse_args(["bench", "--sharded-ranks", "none"]).sharded_ranks) == ([2, 3], [])
