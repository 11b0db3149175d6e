"""Bad command-line values are refused before anything starts, naming the option."""

from __future__ import annotations

import getpass
import json
import os

import pytest

from weightsync.core import registry
from weightsync.core.plugin import Serving
from weightsync.tools.cli import build_parser, demo_transports, main
from weightsync.tools.cluster import JOB_CONFIG_VAR, _joining_env, connect, inherited_by_ray


@pytest.mark.parametrize(
    ("argv", "option", "shown"),
    [
        (["demo", "--steps", "0"], "--steps", "0"),
        (["demo", "--steps", "-1"], "--steps", "-1"),
        (["demo", "--steps", "two"], "--steps", "two"),
        (["demo", "--workers", "0"], "--workers", "0"),
        (["demo", "--num-buffers", "0"], "--num-buffers", "0"),
        (["demo", "--buffer-mib", "0"], "--buffer-mib", "0"),
        (["demo", "--buffer-mib", "0.3"], "--buffer-mib", "256-byte"),
        (["demo", "--buffer-mib", "1e-9"], "--buffer-mib", "1e-9"),
        (["demo", "--buffer-mib", "inf"], "--buffer-mib", "inf"),
        (["demo", "--buffer-mib", "nan"], "--buffer-mib", "nan"),
        (["demo", "--timeout", "0"], "--timeout", "0"),
        (["demo", "--timeout", "-5"], "--timeout", "-5"),
        (["demo", "--timeout", "inf"], "--timeout", "inf"),
        (["bench", "--timeout", "0"], "--timeout", "0"),
        (["cluster", "start", "--timeout", "-1"], "--timeout", "-1"),
        (["cluster", "submit", "--timeout", "nan", "--", "true"], "--timeout", "nan"),
        (["cluster", "stop", "--timeout", "soon"], "--timeout", "soon"),
        (["cluster", "submit", "--address", "127.0.0.1:6379", "--", "true"], "--address", "127.0.0.1:6379"),
        (["bench", "--repeats", "0"], "--repeats", "0"),
        (["bench", "--transports", "ipc,nccl-fast"], "--transports", "nccl-fast"),
        (["bench", "--transports", ","], "--transports", "at least one"),
        (["bench", "--sizes", "1mb,3tb"], "--sizes", "3tb"),
        (["bench", "--buffer-mib", "256,0"], "--buffer-mib", "0"),
        (["bench", "--sharded-ranks", "2,0"], "--sharded-ranks", "0"),
        (["bench", "--sharded-ranks", "two"], "--sharded-ranks", "two"),
        (["demo", "--transport", "owners"], "--transport", "owners"),
        (["demo", "--transport", "owner-writes"], "--transport", "sharded trainer"),
        (["demo", "--transport", "rank-ipc"], "--transport", "rank-ipc"),
        (["demo", "--transport", "bogus"], "--transport", "bogus"),
        (["bench", "--changed", "0%"], "--changed", "0%"),
        (["bench", "--changed", "1%,150%"], "--changed", "150%"),
        (["bench", "--changed", "adamw:fast"], "--changed", "adamw:fast"),
        (["bench", "--changed", "10"], "--changed", "10"),
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
    assert (args.steps, args.workers, args.buffer_bytes) == (1, 3, 512 * 1024)
    assert build_parser().parse_args(["demo", "--timeout", "0.5"]).timeout_s == 0.5
    bench = build_parser().parse_args(["bench", "--repeats", "2", "--transports", "ipc,direct", "--sizes", "1mb"])
    assert (bench.repeats, bench.transports, bench.sizes) == (2, ["ipc", "direct"], ["1mb"])
    assert bench.sharded_ranks is None  # the run picks its default (CPU: 2 ranks)
    ranks = build_parser().parse_args(["bench", "--sharded-ranks", "2,3"]).sharded_ranks
    assert (ranks, build_parser().parse_args(["bench", "--sharded-ranks", "none"]).sharded_ranks) == ([2, 3], [])


def test_sharded_bench_rows_use_the_library_default_unless_buffer_mib_is_given() -> None:
    from weightsync.tools.bench.sharded import sharded_buffer_bytes

    plain = build_parser().parse_args(["bench"])
    plain.buffer_mib_given = plain.buffer_mib is not None  # what the bench's run() records
    assert sharded_buffer_bytes(plain) == "auto"
    asked = build_parser().parse_args(["bench", "--buffer-mib", "64,256"])
    asked.buffer_mib_given = asked.buffer_mib is not None
    assert sharded_buffer_bytes(asked) == 64 * 1024 * 1024


def test_the_bench_compares_an_engine_fed_per_rank_with_the_relay() -> None:
    from weightsync.tools.bench.report import Case, ratios

    assert build_parser().parse_args(["bench"]).vllm_tp is None  # off unless asked
    assert build_parser().parse_args(["bench", "--vllm-tp", "2"]).vllm_tp == 2
    assert build_parser().parse_args(["bench"]).vllm_staged is False
    assert build_parser().parse_args(["bench", "--vllm-staged"]).vllm_staged is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--vllm-tp", "0"])
    relay = Case("100mb", "vllm TP=2, 2 ranks: relay", 10**8, times=[0.5, 0.4, 0.6])
    fed = Case("100mb", "vllm TP=2, 2 ranks: rank-ipc", 10**8, times=[0.2, 0.25, 0.3])
    (line,) = [x for x in ratios([relay, fed], "100mb", 2) if "rank-ipc vs relay" in x]
    assert "2.00x" in line and "500.00 ms against 250.00 ms" in line


def test_the_bench_mib_column_shows_buffers_under_one_mib() -> None:
    from weightsync.tools.bench.report import mib_column

    assert mib_column(None) == ""
    assert mib_column(0.9375) == "0.938"  # a 1 MB model's "auto" buffer: not blank
    assert (mib_column(16.0), mib_column(2048.0)) == ("16", "2048")


def test_ray_workers_get_the_checkout_on_their_path_not_the_package_folder() -> None:
    # With the package folder itself on PYTHONPATH, `import vllm` in a worker finds
    # weightsync/vllm instead of vLLM.
    from pathlib import Path

    from weightsync.tools import cluster

    root = Path(cluster._PROJECT_ROOT)
    assert (root / "weightsync" / "__init__.py").is_file(), root


@pytest.mark.parametrize(
    ("value", "shown"), [("[1]", "got list"), ("{env_vars: 1}", "not JSON"), ('"text"', "got str")]
)
def test_a_runtime_env_that_is_not_a_json_object_is_refused_naming_the_option(
    value: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["cluster", "submit", "--runtime-env-json", value, "--", "true"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --runtime-env-json" in err and shown in err, err


def test_the_command_line_works_for_a_user_the_system_cannot_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container run with an arbitrary uid has no passwd entry: getuser() raises."""

    def nameless() -> str:
        raise KeyError(f"getpwuid(): uid not found: {os.getuid()}")

    monkeypatch.setattr(getpass, "getuser", nameless)
    monkeypatch.delenv("WEIGHTSYNC_HEAD_DIR", raising=False)
    args = build_parser().parse_args(["cluster", "env"])
    assert args.dir.name.startswith(f"weightsync-head-uid{os.getuid()}-"), args.dir
    assert build_parser().parse_args(["demo", "--steps", "1"]).steps == 1


@pytest.mark.parametrize("via_env", [False, True], ids=["--address", "RAY_ADDRESS"])
def test_a_job_server_address_is_refused_naming_where_it_came_from(
    via_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `cluster env` exports is for `ray job submit`; ray.init cannot join it."""
    url = "http://127.0.0.1:8265"
    if via_env:
        monkeypatch.setenv("RAY_ADDRESS", url)
    with pytest.raises(ValueError, match="RAY_ADDRESS" if via_env else "--address") as err:
        connect(None if via_env else url)
    assert url in str(err.value) and "unset RAY_ADDRESS" in str(err.value)


def test_a_job_that_sets_its_own_pythonpath_joins_without_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray refuses to merge the same variable from the job's runtime env and ray.init's."""
    ours = {"env_vars": {"PYTHONPATH": "/checkout"}}
    monkeypatch.delenv(JOB_CONFIG_VAR, raising=False)
    assert _joining_env(ours) == ours  # not a job's driver
    monkeypatch.setenv(JOB_CONFIG_VAR, json.dumps({"runtime_env": {"working_dir": "/x"}, "metadata": {}}))
    assert _joining_env(ours) == ours
    job_env = {"working_dir": "/x", "env_vars": {"PYTHONPATH": "/my/libs"}}
    monkeypatch.setenv(JOB_CONFIG_VAR, json.dumps({"runtime_env": job_env, "metadata": {}}))
    assert _joining_env(ours) is None


def test_the_environment_a_local_cluster_inherits_is_set_only_while_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an embedded cluster's actors get (this checkout on their PYTHONPATH) leaves this
    process's environment as it was, also when starting fails."""
    monkeypatch.setenv("WEIGHTSYNC_TEST_KEPT", "before")
    monkeypatch.delenv("WEIGHTSYNC_TEST_ADDED", raising=False)
    with pytest.raises(RuntimeError, match="ray.init failed"):
        with inherited_by_ray({"WEIGHTSYNC_TEST_KEPT": "during", "WEIGHTSYNC_TEST_ADDED": "during"}):
            assert os.environ["WEIGHTSYNC_TEST_KEPT"] == os.environ["WEIGHTSYNC_TEST_ADDED"] == "during"
            raise RuntimeError("ray.init failed")
    assert os.environ["WEIGHTSYNC_TEST_KEPT"] == "before"
    assert "WEIGHTSYNC_TEST_ADDED" not in os.environ


def test_demo_offers_only_the_transports_its_one_trainer_process_can_serve() -> None:
    offered = demo_transports()
    assert offered[0] == "auto" and {"broadcast", "ipc", "direct"} <= set(offered)
    for name in offered[1:]:
        assert registry.get(name).serving is not Serving.EVERY, name
    assert not {"owners", "owner-writes", "rank-ipc"} & set(offered)
    demo = next(
        a for a in build_parser()._subparsers._group_actions[0].choices["demo"]._actions if a.dest == "transport"
    )
    assert demo.metavar == "{" + ",".join(offered) + "}"


def test_a_refusal_is_one_line_on_stderr_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shell that exported what `cluster env` prints for `ray job submit` runs the demo."""
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    assert main(["demo", "--steps", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("weightsync demo: error: RAY_ADDRESS=http://127.0.0.1:8265 is a job server")


def test_doctor_prints_each_transport_under_its_own_name_once(capsys: pytest.CaptureFixture[str]) -> None:
    for transport in registry.transports():
        if transport.usable_here is not None:
            for label, _ in transport.usable_here():
                assert label.split(" ", 1)[0] == transport.name, (transport.name, label)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.split("transports:\n", 1)[1].splitlines() if line.startswith("  ")]
    labels = [row[2:].split("  ")[0] for row in rows]  # "  <label, padded>  usable" or "... unusable: why"
    assert len(labels) == len(set(labels)) and any(label.startswith("owner-writes") for label in labels), rows
