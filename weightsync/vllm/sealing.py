"""Sealed messages between a :class:`~weightsync.vllm.ServerWorker` and a vLLM server's workers.

vLLM 0.32's RL routes (``/init_weight_transfer_engine``, ``/update_weights``, ...) carry no
authentication: its ``--api-key`` guards only ``/v1`` and a few other prefixes. weightsync's
calls and answers are pickled objects, and unpickling runs code, so nothing that arrives
over HTTP or over the reply connection is unpickled before its seal is checked: an
HMAC-SHA256 under a key that the server and the ServerWorker read from a file of their own
(``WEIGHTSYNC_SERVER_KEY_FILE``). Whoever lacks the key can neither make the server's
workers run a call nor make the ServerWorker accept an answer. Call order::

    key = read_key(path)                                   # both sides, once
    data = seal(key, {"kind": "call", ...}, body)          # the sender
    header, body = unseal(key, data, "call")               # the receiver; raises SealError

A sealed message is ``MAGIC | len(header) | len(body) | header (JSON) | body | HMAC`` with
the HMAC over everything before it; ``header["kind"]`` keeps a message of one kind from
being taken for another. Replays are refused one level up (:mod:`weightsync.vllm.remote`:
every call names the server worker's fresh nonce and a sequence number that only grows).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import stat
import struct
from typing import Any

from weightsync import WeightSyncError

#: The environment variable that names the key file, on the server and for the ServerWorker.
KEY_FILE_ENV = "WEIGHTSYNC_SERVER_KEY_FILE"
#: The fewest bytes a key may have (after surrounding whitespace is stripped).
MIN_KEY_BYTES = 32
MAGIC = b"WSS1"
_LENGTHS = struct.Struct(">II")
_MAC_BYTES = hashlib.sha256().digest_size
#: The largest header a sealed message may carry (the body is bounded by its reader).
MAX_HEADER_BYTES = 1 << 16
MAKE_KEY = "umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > FILE"


class SealError(WeightSyncError):
    """A sealed message is malformed, of another kind, or its seal does not match the key."""


def read_key(path: str | os.PathLike[str] | None, who: str = "weightsync") -> bytes:
    """The key in ``path`` (``None``: the file ``WEIGHTSYNC_SERVER_KEY_FILE`` names).

    The file must be a regular file of this user with no group or other permission bits,
    reached without a symlink, holding at least :data:`MIN_KEY_BYTES` bytes; anything else
    is refused naming the file and what to do."""
    if path is None:
        path = os.environ.get(KEY_FILE_ENV) or None
        if path is None:
            raise WeightSyncError(
                f"{who}: no key for sealing weightsync's calls to a vLLM server: set {KEY_FILE_ENV} to a file "
                f"holding one (make it with `{MAKE_KEY}`), for the server and for the ServerWorker (key_file=)"
            )
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise WeightSyncError(f"{who}: cannot open the key file {name} ({exc.strerror}); {_fix(name)}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WeightSyncError(f"{who}: the key file {name} is not a regular file; {_fix(name)}")
        if st.st_uid != os.geteuid():
            raise WeightSyncError(f"{who}: the key file {name} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o077:
            raise WeightSyncError(
                f"{who}: the key file {name} has mode {stat.S_IMODE(st.st_mode):04o}, which lets others read it; "
                f"chmod 600 {name}"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            key = f.read(4096).strip()
    finally:
        os.close(fd)
    if len(key) < MIN_KEY_BYTES:
        raise WeightSyncError(
            f"{who}: the key file {name} holds {len(key)} bytes, fewer than {MIN_KEY_BYTES}; {_fix(name)}"
        )
    return key


def _fix(name: str) -> str:
    return f"make it with `{MAKE_KEY.replace('FILE', name)}`"


def seal(key: bytes, header: dict[str, Any], body: bytes = b"") -> bytes:
    """``header`` (JSON-able, with a ``kind``) and ``body``, sealed under ``key``."""
    if not isinstance(header.get("kind"), str):
        raise ValueError(f"a sealed header names its kind, got {header!r}")
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"a sealed header holds at most {MAX_HEADER_BYTES} bytes, got {len(head)}")
    message = MAGIC + _LENGTHS.pack(len(head), len(body)) + head + bytes(body)
    return message + hmac.new(key, message, hashlib.sha256).digest()


def unseal(key: bytes, data: bytes, kind: str) -> tuple[dict[str, Any], bytes]:
    """The header and body of ``data`` once its seal matches ``key`` and its kind is ``kind``."""
    prefix = len(MAGIC) + _LENGTHS.size
    if len(data) < prefix + _MAC_BYTES or data[: len(MAGIC)] != MAGIC:
        raise SealError(f"a sealed {kind} was expected; what arrived is not a weightsync sealed message")
    head_len, body_len = _LENGTHS.unpack_from(data, len(MAGIC))
    if head_len > MAX_HEADER_BYTES or prefix + head_len + body_len + _MAC_BYTES != len(data):
        raise SealError(f"a sealed {kind} of inconsistent length ({len(data)} bytes)")
    message, mac = data[:-_MAC_BYTES], data[-_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, message, hashlib.sha256).digest()):
        raise SealError(
            f"a {kind} sealed under another key (or altered on the way) was refused: the server and the "
            f"ServerWorker must read the same key ({KEY_FILE_ENV})"
        )
    try:
        header = json.loads(message[prefix : prefix + head_len])
    except ValueError as exc:  # sealed under our key, so only a bug gets here
        raise SealError(f"a sealed {kind}'s header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("kind") != kind:
        found = header.get("kind") if isinstance(header, dict) else type(header).__name__
        raise SealError(f"a sealed {kind} was expected, a sealed {found!r} arrived")
    return header, message[prefix + head_len :]


def seal_text(key: bytes, header: dict[str, Any], body: bytes = b"") -> str:
    """:func:`seal` as base64 text, for a JSON field of an HTTP request."""
    return base64.b64encode(seal(key, header, body)).decode("ascii")


def unseal_text(key: bytes, text: str, kind: str) -> tuple[dict[str, Any], bytes]:
    """:func:`unseal` of :func:`seal_text`'s text."""
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise SealError(f"a sealed {kind} arrives as base64 text; this is not ({exc})") from exc
    return unseal(key, data, kind)


__all__ = [
    "KEY_FILE_ENV",
    "MIN_KEY_BYTES",
    "SealError",
    "read_key",
    "seal",
    "seal_text",
    "unseal",
    "unseal_text",
]
