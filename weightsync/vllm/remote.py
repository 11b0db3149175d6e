"""A ServerWorker's session with a vLLM server, as both ends seal and check it.

The ServerWorker (a Ray actor) reaches the server's workers through vLLM's RL routes, and
the weightsync backend in each worker (:mod:`weightsync.vllm.backend`) holds a
:class:`RemoteLink` for it. Every message is sealed under the shared key
(:mod:`weightsync.vllm.sealing`); on top of that a call must name the session, each rank's
fresh nonce (sent in its hello, so a call recorded in an earlier session is refused) and a
sequence number higher than the last one the rank ran (so no call runs twice). Call order::

    # the ServerWorker                                  # each TP rank, in the backend
    text = seal_init(key, ServerInit(...))
    POST /init_weight_transfer_engine {"server": text}  -> link = RemoteLink.accept(text)
                                                           link.connect(rank, size, updating)
    POST /update_weights {"call": seal_call(...)}       -> payload = link.open_call(text)
                                                           ... run it ...; link.reply(reply bytes)

Nothing here imports Ray or vLLM.
"""

from __future__ import annotations

import os
import pickle
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

import weightsync
from weightsync import TensorSpec, WeightSyncError
from weightsync.vllm.replies import ReplyLine
from weightsync.vllm.sealing import SealError, read_key, seal, seal_text, unseal_text

#: The field of ``init_info`` that carries a sealed :class:`ServerInit`.
INIT_FIELD = "server"


@dataclass(frozen=True, kw_only=True)
class ServerInit:
    """What each TP rank is told once per session (sealed in the ``/init_weight_transfer_engine`` call)."""

    #: The worker's name, for messages.
    name: str
    #: This session's id: 16 random bytes as hex, fresh at every init.
    session: str
    #: Where the rank connects back to answer (the ServerWorker's listener).
    reply_host: str
    reply_port: int
    #: How long the rank waits to connect and to hand over a reply.
    timeout_s: float
    #: The tensors the trainer must send; None with ``check_model``: read from the server's
    #: own checkpoint; None without: any trainer's.
    expected_specs: tuple[TensorSpec, ...] | None = None
    check_model: bool = True
    #: The weightsync version of the ServerWorker (both ends must run the same).
    version: str = weightsync.__version__

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ServerInit.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.session, str) or len(self.session) < 32:
            raise ValueError("ServerInit.session must be at least 16 random bytes, as hex")
        if not isinstance(self.reply_port, int) or not 0 < self.reply_port < 65536 or not self.reply_host:
            raise ValueError(f"ServerInit needs a reply address, got {self.reply_host!r}:{self.reply_port!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"ServerInit.timeout_s must be positive, got {self.timeout_s!r}")
        if self.expected_specs is not None and not all(isinstance(s, TensorSpec) for s in self.expected_specs):
            raise ValueError("ServerInit.expected_specs must be TensorSpecs")

    def specs(self, vllm_config: Any) -> list[TensorSpec] | None:
        """What this rank's engine expects: the given specs, or its checkpoint's."""
        if self.expected_specs is not None:
            return list(self.expected_specs)
        if not self.check_model:
            return None
        from weightsync.vllm.checkpoint import engine_specs

        return engine_specs(self.name, vllm_config)


def seal_init(key: bytes, init: ServerInit) -> str:
    return seal_text(key, {"kind": "init", "session": init.session}, bytes(cloudpickle.dumps(init)))


def seal_call(key: bytes, session: str, nonces: Sequence[str], seq: int, payload: bytes) -> str:
    """One encoded weightsync call (``codec.encode_call``) for every rank of ``session``."""
    return seal_text(key, {"kind": "call", "session": session, "nonces": list(nonces), "seq": seq}, payload)


def new_session() -> str:
    return secrets.token_hex(16)


def hand_over(old: Any, new: Any) -> None:
    """A new session's endpoint (a ``RankEndpoint``) takes over what this rank holds from the
    last session's: its version (``dirty`` when that session was loading: its reload is
    closed first, so the model runs again, on a mix of versions until the next sync) and
    its counts of tensors loaded and relayed."""
    from weightsync import WorkerState

    held = old.receiver_state()
    old.end_reload()
    new.loaded, new.relayed, new.fed_by = old.loaded, old.relayed, old.fed_by
    if held is None:
        return
    receiver = new._wr()
    receiver.version = held[0]
    loading = held[1] == WorkerState.RECEIVING.value
    receiver.state = WorkerState.DIRTY if loading else WorkerState(held[1])


class RemoteLink:
    """One TP rank's end of a ServerWorker's session (inside the vLLM server's worker)."""

    def __init__(self, key: bytes, init: ServerInit) -> None:
        self.key = key
        self.init = init
        self.rank = 0
        self.nonce = ""
        self.seq = 0
        self._line: ReplyLine | None = None

    @classmethod
    def accept(cls, text: Any) -> RemoteLink:
        """The link a sealed init asks for, once its seal matches this server's key."""
        if not isinstance(text, str):
            raise WeightSyncError(f"init_info['{INIT_FIELD}'] must be a ServerWorker's sealed init (text)")
        key = read_key(None, who="this vLLM server's weightsync backend")
        try:
            _, body = unseal_text(key, text, "init")
        except SealError as exc:
            raise WeightSyncError(f"this vLLM server refused a ServerWorker's init: {exc}") from exc
        init = pickle.loads(body)  # sealed under our key: a ServerWorker's own bytes
        if not isinstance(init, ServerInit):
            raise WeightSyncError(f"a sealed init holds a {type(init).__name__}, not a ServerInit")
        if init.version != weightsync.__version__:
            raise WeightSyncError(
                f"the ServerWorker runs weightsync {init.version} and this server {weightsync.__version__}; "
                "run the same version on both"
            )
        return cls(key, init)

    def connect(self, rank: int, size: int, updating: bool) -> None:
        """Connect back to the ServerWorker as TP rank ``rank`` of ``size`` and say hello."""
        self.rank, self.nonce, self.seq = rank, secrets.token_hex(16), 0
        self._line = ReplyLine(self.init.reply_host, self.init.reply_port, self.init.timeout_s)
        hello = {
            "kind": "hello",
            "session": self.init.session,
            "rank": rank,
            "size": size,
            "pid": os.getpid(),
            "nonce": self.nonce,
            "updating": updating,
            "version": weightsync.__version__,
        }
        self._line.send(seal(self.key, hello))

    def open_call(self, text: str) -> bytes:
        """The call in a sealed text, refused unless it belongs to this session and rank and
        comes after the last call run here."""
        try:
            header, body = unseal_text(self.key, text, "call")
        except SealError as exc:
            raise WeightSyncError(f"{self.init.name}: a call was refused: {exc}") from exc
        nonces, seq = header.get("nonces"), header.get("seq")
        mine = isinstance(nonces, list) and len(nonces) > self.rank and nonces[self.rank] == self.nonce
        if header.get("session") != self.init.session or not mine:
            raise WeightSyncError(
                f"{self.init.name}: a call of another session was refused (a newer ServerWorker init replaced it, "
                "or the call was recorded earlier)"
            )
        if not isinstance(seq, int) or seq <= self.seq:
            raise WeightSyncError(f"{self.init.name}: call {seq!r} was refused: call {self.seq} already ran here")
        self.seq = seq
        return body

    def reply(self, body: bytes) -> None:
        """Answer the last call opened."""
        if self._line is None:
            raise WeightSyncError(f"{self.init.name}: no reply connection (connect was not called)")
        header = {"kind": "reply", "session": self.init.session, "rank": self.rank, "seq": self.seq}
        self._line.send(seal(self.key, header, body))

    def close(self) -> None:
        if self._line is not None:
            self._line.close()
            self._line = None


__all__ = ["INIT_FIELD", "RemoteLink", "ServerInit", "hand_over", "new_session", "seal_call", "seal_init"]
