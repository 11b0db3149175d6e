"""The names of weightsync's shared-memory regions: what a name says and what it may be.

Every region is a file directly in ``/dev/shm`` named::

    weightsync-<pid>-<pidns>-<scope>-<session>-<tag>

``pid`` and ``pidns`` are the creator's process id and the inode of its pid namespace
(``/proc/self/ns/pid``), so an orphan sweep judges a creator's liveness only where that pid
means something: in its own namespace. ``scope`` is ``$WEIGHTSYNC_SHM_SCOPE`` (default
``0``), a label a job can give every region it and its children create, so its regions can
be told apart from another job's on the same host (the test suite checks only its own).
``session`` is random, ``tag`` says what the region is for (``slots``, ``ctl``, ...).

A path received from another process is used only when it has exactly this shape
(:func:`confined_path`): a handle naming any other file is refused before it is opened.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass

from weightsync.core.wire.errors import ForeignPath, SettingsError

SHM_DIR = "/dev/shm"
SHM_PREFIX = "weightsync-"
SCOPE_ENV = "WEIGHTSYNC_SHM_SCOPE"
DEFAULT_SCOPE = "0"
_SCOPE = re.compile(r"[A-Za-z0-9]{1,32}\Z")
_TAG = re.compile(r"[a-z0-9]{1,16}\Z")
_NAME = re.compile(r"weightsync-(\d{1,10})-(\d{1,20})-([A-Za-z0-9]{1,32})-([0-9a-f]{16})-([a-z0-9]{1,16})\Z")


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where ``/proc`` does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def current_scope() -> str:
    """This process's region scope: ``$WEIGHTSYNC_SHM_SCOPE``, or ``0`` when unset."""
    scope = os.environ.get(SCOPE_ENV, "") or DEFAULT_SCOPE
    if not _SCOPE.match(scope):
        raise SettingsError(f"{SCOPE_ENV}={scope!r} is not a region scope: use 1 to 32 letters or digits (or unset it)")
    return scope


@dataclass(frozen=True)
class SegmentName:
    """A parsed region name (see the module docstring for the layout)."""

    pid: int
    pidns: int
    scope: str
    session: str
    tag: str

    def __post_init__(self) -> None:
        if not _TAG.match(self.tag):
            raise SettingsError(f"region tag {self.tag!r} must be 1 to 16 lowercase letters or digits")

    @classmethod
    def fresh(cls, tag: str) -> SegmentName:
        """A new name for a region this process creates."""
        return cls(os.getpid(), pid_namespace(), current_scope(), uuid.uuid4().hex[:16], tag)

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        """The parts of ``name``, or None when it is not a weightsync region's name."""
        match = _NAME.match(name)
        if match is None:
            return None
        pid, pidns, scope, session, tag = match.groups()
        return cls(int(pid), int(pidns), scope, session, tag)

    def __str__(self) -> str:
        return f"{SHM_PREFIX}{self.pid}-{self.pidns}-{self.scope}-{self.session}-{self.tag}"


def confined_path(path: object, what: str) -> SegmentName:
    """The name behind ``path`` if it is a weightsync region directly in ``/dev/shm``;
    anything else (another directory, ``..``, a file of another name) is refused by name."""
    if (
        not isinstance(path, str)
        or os.path.dirname(path) != SHM_DIR
        or (name := SegmentName.parse(os.path.basename(path))) is None
    ):
        raise ForeignPath(
            f"{what}: {path!r} is not a weightsync shared-memory region; a handle may only name a file "
            f"{SHM_DIR}/{SHM_PREFIX}<pid>-<pidns>-<scope>-<session>-<tag>, and this one was refused unopened"
        )
    return name
