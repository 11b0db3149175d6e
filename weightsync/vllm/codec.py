"""What crosses vLLM's worker RPC: bytes that weightsync encodes and decodes itself.

vLLM's ``collective_rpc`` carries arguments and results over msgpack: dataclasses arrive
as dicts, other objects only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, and a result it
cannot serialize kills the engine's output thread (the call then never returns). So every
weightsync call into a vLLM worker is one :class:`Call` pickled to ``bytes``, and every
answer is one :class:`Reply` pickled to ``bytes``; msgpack only ever sees ``bytes``.

Call order::

    payload = encode_call(Call("ws_accept", (manifest, "vllm")))   # in the Ray actor
    reply_bytes = worker.weightsync_call(payload)                   # in each vLLM worker
    value = decode_reply(reply_bytes, who="vllm rank 0")            # raises the remote error

:func:`run_call` is the worker's half: it never raises and always returns bytes, also
when the result itself cannot be pickled (the reply then names its type).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from weightsync import WeightSyncError
from weightsync.core.wire.report import StageReport


class RemoteCallError(WeightSyncError):
    """A call inside a vLLM worker failed; the message names the rank and the call."""

    def __init__(self, message: str, error_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:  # crosses Ray with its fields
        return type(self), (str(self), self.error_type, self.remote_traceback)


@dataclass(frozen=True)
class Call:
    """One call into a vLLM worker: a method name (or a callable taking the worker first)."""

    target: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: A protocol call that every TP rank runs as a receiver of its own, rather than rank 0
    #: leading and the others following (see ``parts.py``); the engine actor decides.
    every_rank: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.target, str) and self.target) and not callable(self.target):
            raise TypeError(f"Call.target must be a method name or a callable, got {self.target!r}")
        if not isinstance(self.args, tuple) or not isinstance(self.kwargs, dict):
            raise TypeError("Call.args must be a tuple and Call.kwargs a dict")
        if not isinstance(self.every_rank, bool):
            raise TypeError(f"Call.every_rank must be True or False, got {self.every_rank!r}")

    @property
    def label(self) -> str:
        return self.target if isinstance(self.target, str) else getattr(self.target, "__name__", "callable")


@dataclass(frozen=True)
class Reply:
    """A worker's answer: the value, or the error's type, message and traceback.

    ``state`` carries the rank's receiver state after the call (version, state name), so
    the engine actor can report the weight version and reset caches without asking again.
    A staged call's reply also says whether this rank's stage holds a sync waiting for its
    swap (``staged``), the version its receiver checked and marked ready for the swap
    (``ready``; None on a rank without a receiver of its own, or before the commit), and
    where its stage lives (``stage``).
    """

    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    remote_traceback: str = ""
    state: tuple[int | None, str] | None = None
    staged: bool = False
    ready: int | None = None
    stage: StageReport | None = None

    def __post_init__(self) -> None:
        if not self.ok and not self.error_type:
            raise ValueError("a failed Reply needs its error_type")


def encode_call(call: Call) -> bytes:
    if not isinstance(call, Call):
        raise TypeError(f"expected a Call, got {type(call).__name__}")
    return bytes(cloudpickle.dumps(call))


def decode_call(payload: bytes) -> Call:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise TypeError(f"a weightsync call arrives as bytes, got {type(payload).__name__}")
    call = cloudpickle.loads(payload)
    if not isinstance(call, Call):
        raise TypeError(f"the payload decoded to {type(call).__name__}, not a weightsync Call")
    return call


def encode_reply(reply: Reply) -> bytes:
    """Pickle ``reply``; a value that cannot be pickled becomes a failed reply naming it."""
    try:
        return bytes(cloudpickle.dumps(reply))
    except Exception as exc:  # noqa: BLE001 - reported to the caller as a failed reply, never raised here
        failed = Reply(
            ok=False,
            error_type="UnpicklableResult",
            message=f"the result ({type(reply.value).__name__}) cannot be pickled: {type(exc).__name__}: {exc}",
            state=reply.state,
        )
        return bytes(cloudpickle.dumps(failed))


def failed_reply(exc: BaseException, state: tuple[int | None, str] | None = None) -> Reply:
    return Reply(
        ok=False,
        error_type=type(exc).__name__,
        message=str(exc),
        remote_traceback="".join(traceback.format_exception(exc)),
        state=state,
    )


def decode_reply(data: Any, who: str, what: str) -> Reply:
    """The :class:`Reply` in ``data``; raises naming ``who`` if it is not one."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WeightSyncError(f"{who}: {what} answered {type(data).__name__}, expected weightsync's reply bytes")
    reply = cloudpickle.loads(data)
    if not isinstance(reply, Reply):
        raise WeightSyncError(f"{who}: {what} answered a {type(reply).__name__}, expected a weightsync Reply")
    return reply


def unwrap(reply: Reply, who: str, what: str) -> Any:
    """The reply's value, or :class:`RemoteCallError` naming ``who`` and ``what``."""
    if reply.ok:
        return reply.value
    raise RemoteCallError(
        f"{who}: {what} failed: {reply.error_type}: {reply.message}", reply.error_type, reply.remote_traceback
    )


def run_call(call: Callable[[], Any], state: Callable[[], tuple[int | None, str] | None]) -> bytes:
    """Run ``call``, then read ``state``, and encode the outcome; an ``Exception`` from
    either becomes a failed reply (the caller re-raises it), so this returns bytes."""
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
        try:
            after = state()
        except Exception:  # noqa: BLE001 - the call's own error is the one to report
            after = None
        return encode_reply(failed_reply(exc, after))
    try:
        return encode_reply(Reply(ok=True, value=value, state=state()))
    except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
        return encode_reply(failed_reply(exc))
