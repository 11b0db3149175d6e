"""``cluster start | submit | env | stop``: a local head and jobs on it.

From the repository root::

    bash scripts/run.sh cluster start                 # loopback head, token auth, job server
    bash scripts/run.sh cluster submit -- python -m weightsync demo --workers 2
    eval "$(bash scripts/run.sh cluster env)"         # then plain `.venv/bin/ray job submit ...` works
    bash scripts/run.sh cluster stop                  # stops this head only

``submit`` also takes ``--address URL --token-file FILE`` for a head it did not start.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from weightsync.tools.cli_types import DefaultsHelpFormatter, Subparsers, positive_seconds
from weightsync.tools.head import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    HeadError,
    HeadInfo,
    default_directory,
    head_running,
    read_info,
    read_token,
    start_head,
    stop_head,
)
from weightsync.tools.jobs import JobServer
from weightsync.tools.private_files import UnsafePathError

#: Seconds ``submit`` follows a job before it stops it.
JOB_TIMEOUT_S = 900.0
#: Left out of the uploaded working directory (Ray itself leaves out ``.git``): caches and the
#: virtual environment, which the head has already.
UPLOAD_EXCLUDES = (
    ".venv/",
    ".hypothesis/",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
    "__pycache__/",
    ".devsite/",
)


def job_runtime_env(working_dir: str, extra_json: str | None = None) -> dict[str, Any]:
    """The job's runtime env: ``working_dir`` uploaded without :data:`UPLOAD_EXCLUDES`, then
    ``--runtime-env-json`` merged over it (its ``excludes``, if any, replace these)."""
    runtime_env: dict[str, Any] = {"working_dir": working_dir, "excludes": list(UPLOAD_EXCLUDES)}
    runtime_env.update(json.loads(extra_json) if extra_json else {})
    return runtime_env


def _job_server_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"expected the job server's http(s) address (the dashboard, e.g. http://HEAD:8265), got {value!r}"
        )
    return value


def _json_object(value: str) -> str:
    """``--runtime-env-json``: the text of a JSON object; anything else is refused, saying what it was."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {type(parsed).__name__}: {value!r}")
    return value


def _running_head(directory: Path) -> HeadInfo:
    info = read_info(directory)
    if info is None:
        raise HeadError(f"no head recorded in {directory}: start one with `bash scripts/run.sh cluster start`")
    if not head_running(info):
        raise HeadError(
            f"the head recorded in {directory} (pid {info.pid}) is not running any more: start a new one with "
            "`bash scripts/run.sh cluster start`"
        )
    return info


def _start(args: argparse.Namespace) -> int:
    print(f"starting a Ray head in {args.dir} (loopback, token auth, job server) ...", flush=True)
    info = start_head(args.dir, num_cpus=args.num_cpus, timeout_s=args.timeout_s)
    print(f"head running: pid {info.pid}, GCS {info.gcs_address}, job server {info.dashboard_url}")
    print(f"token: {info.token_path} (mode 0600); ray start's output: {args.dir / 'head.log'}")
    where = f" --dir {shlex.quote(str(args.dir))}" if args.dir != default_directory() else ""
    print("from the repository root:")
    print(f"submit:  bash scripts/run.sh cluster submit{where} -- python -m weightsync demo --workers 2")
    print(
        f'or:      eval "$(bash scripts/run.sh cluster env{where})"; '
        ".venv/bin/ray job submit --working-dir . -- python -m weightsync demo --workers 2"
    )
    print(f"stop:    bash scripts/run.sh cluster stop{where}")
    return 0


def _env(args: argparse.Namespace) -> int:
    for name, value in _running_head(args.dir).env().items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    print(stop_head(args.dir, timeout_s=args.timeout_s))
    exported = os.environ.get("RAY_ADDRESS", "")
    if exported.startswith(("http://", "https://")):
        print(
            f"this shell still exports RAY_ADDRESS={exported} (from `cluster env`): unset RAY_ADDRESS RAY_AUTH_MODE RAY_AUTH_TOKEN_PATH"
        )
    return 0


def _submit(args: argparse.Namespace) -> int:
    entrypoint = list(args.entrypoint)
    if entrypoint and entrypoint[0] == "--":
        entrypoint = entrypoint[1:]
    if not entrypoint:
        raise HeadError("submit needs an entrypoint after `--`, e.g. -- python -m weightsync demo")
    if args.address:
        if not args.token_file:
            raise HeadError("--address needs --token-file (the head's token; on a head you started: its auth_token)")
        token_path = args.token_file
        server = JobServer(args.address, read_token(Path(token_path)))
    else:
        head = _running_head(args.dir)
        token_path, server = head.token_path, head.job_server
    job_id = server.submit(shlex.join(entrypoint), job_runtime_env(args.working_dir, args.runtime_env_json))
    print(f"submitted job {job_id} to {server.url}", flush=True)
    if args.no_wait:
        return 0
    try:
        status = server.follow(job_id, timeout_s=args.timeout_s)
    except KeyboardInterrupt:
        print(
            f"\njob {job_id} goes on running on {server.url}; to stop it: RAY_AUTH_MODE=token "
            f"RAY_AUTH_TOKEN_PATH={shlex.quote(str(token_path))} .venv/bin/ray job stop --address {server.url} {job_id}",
            file=sys.stderr,
        )
        raise
    print(f"job {job_id}: {status}", flush=True)
    return 0 if status == "SUCCEEDED" else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=Path,
        default=default_directory(),
        help="the head's directory: head.json, auth_token, logs, Ray's temp dir (default: $WEIGHTSYNC_HEAD_DIR, "
        "else %(default)s)",
    )
    _add_start(sub, common)
    _add_submit(sub, common)
    env = sub.add_parser(
        "env",
        parents=[common],
        formatter_class=DefaultsHelpFormatter,
        help="print the exports plain `ray job submit` needs",
    )
    env.set_defaults(cluster_func=_env)
    _add_stop(sub, common)
    parser.set_defaults(func=run)


def _add_start(sub: Subparsers[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    start = sub.add_parser(
        "start",
        parents=[common],
        formatter_class=DefaultsHelpFormatter,
        help="start a loopback Ray head with token auth and jobs",
    )
    start.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)")
    start.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="TIMEOUT",
        type=positive_seconds,
        default=START_TIMEOUT_S,
        help="seconds to wait for the job server",
    )
    start.set_defaults(cluster_func=_start)


def _add_submit(sub: Subparsers[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    submit = sub.add_parser(
        "submit",
        parents=[common],
        formatter_class=DefaultsHelpFormatter,
        help="submit a job and follow its log until it ends",
    )
    submit.add_argument(
        "--address",
        type=_job_server_url,
        help="a job server this command did not start, http://host:8265 (default: the head in --dir)",
    )
    submit.add_argument(
        "--token-file",
        help="with --address: the file holding that head's token (default: none; required with --address)",
    )
    submit.add_argument(
        "--working-dir",
        default=".",
        help="uploaded as the job's working dir, without .git, .venv and caches (default: .)",
    )
    submit.add_argument(
        "--runtime-env-json",
        type=_json_object,
        help='merged into the runtime env, e.g. \'{"py_executable": "..."}\' (default: none)',
    )
    submit.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="TIMEOUT",
        type=positive_seconds,
        default=JOB_TIMEOUT_S,
        help="stop the job after this many seconds",
    )
    submit.add_argument(
        "--no-wait",
        action="store_true",
        help="print the job id and return (default: follow the log until the job ends)",
    )
    submit.add_argument(
        "entrypoint",
        nargs=argparse.REMAINDER,
        help="-- then the command the job runs, e.g. -- python -m weightsync demo",
    )
    submit.set_defaults(cluster_func=_submit)


def _add_stop(sub: Subparsers[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    stop = sub.add_parser(
        "stop",
        parents=[common],
        formatter_class=DefaultsHelpFormatter,
        help="stop the head this checkout started (never `ray stop`)",
    )
    stop.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="TIMEOUT",
        type=positive_seconds,
        default=STOP_TIMEOUT_S,
        help="seconds to wait for the head to exit",
    )
    stop.set_defaults(cluster_func=_stop)


def run(args: argparse.Namespace) -> int:
    try:
        return int(args.cluster_func(args))
    except (HeadError, UnsafePathError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
