"""CPU export over POSIX shared memory: a ``/dev/shm`` file mapped by both processes.

``torch.from_file(path, shared=True)`` in each process is the simplest export that works
between Ray actors (torch's ``file_descriptor`` sharing strategy needs an authkey they do
not share). The producer creates the file; consumers map it once. Once every consumer has
mapped it, :meth:`ShmRegion.unlink` removes the name while the mappings stay valid, so
nothing is left in ``/dev/shm`` even if a process is killed later.

A process killed between creating a region and unlinking it leaves its file behind; the
file's name carries the creator's pid, so the next region made on this host removes the
files whose creator is gone (:func:`remove_orphans`), and only those.
"""

from __future__ import annotations

import os
import socket
import weakref

import torch

from weightsync.core.wire.errors import ExportNotFound
from weightsync.core.wire.messages import ShmHandle
from weightsync.core.wire.shm_names import SHM_DIR, SHM_PREFIX, SegmentName

_swept: set[str] = set()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmRegion:
    """A producer-owned ``/dev/shm`` region of ``nbytes`` bytes, created and mapped once."""

    def __init__(self, nbytes: int, tag: str = "buf", directory: str = SHM_DIR) -> None:
        if directory not in _swept:
            _swept.add(directory)
            remove_orphans(directory)
        name = SegmentName.fresh(tag)
        self.session = name.session
        self.path = os.path.join(directory, str(name))
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        self.nbytes = nbytes
        self.tensor = torch.from_file(self.path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]

    def handle(self) -> ShmHandle:
        return ShmHandle(path=self.path, nbytes=self.nbytes, hostname=socket.gethostname(), session=self.session)

    def unlink(self) -> None:
        """Remove the name; existing mappings (ours and consumers') stay valid."""
        self._finalizer()

    def close(self) -> None:
        self.unlink()
        del self.tensor


def map_shm(handle: ShmHandle) -> torch.Tensor:
    """Map a producer's region in this process (the caller keeps it for the session)."""
    if handle.hostname != socket.gethostname():
        raise ExportNotFound(
            f"shared-memory export {handle.path} lives on host {handle.hostname!r}, this is "
            f"{socket.gethostname()!r}: the ipc transport needs trainer and worker on one node "
            "(use transport='broadcast' across nodes)"
        )
    if not os.path.exists(handle.path):
        raise ExportNotFound(
            f"shared-memory export {handle.path} (session {handle.session}) does not exist: "
            "it was closed, or belongs to a previous session; run WeightSync.setup() again"
        )
    size = max(handle.nbytes, 1)
    actual = os.path.getsize(handle.path)
    if actual < size:
        raise ExportNotFound(
            f"shared-memory export {handle.path} holds {actual} bytes, the handle says "
            f"{handle.nbytes}: a stale or foreign handle"
        )
    return torch.from_file(handle.path, shared=True, size=size, dtype=torch.uint8)[: handle.nbytes]


def leftover_segments(directory: str = SHM_DIR, *, scope: str | None = None) -> list[str]:
    """Names of weightsync regions in ``directory`` (for tests and ``doctor``); with
    ``scope``, only the regions created under that scope (``$WEIGHTSYNC_SHM_SCOPE``)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(SHM_PREFIX))
    except FileNotFoundError:
        return []
    if scope is None:
        return names
    return [n for n in names if (parsed := SegmentName.parse(n)) is not None and parsed.scope == scope]


def creator_pid(name: str) -> int | None:
    """The pid embedded in a region's file name (see :mod:`weightsync.core.wire.shm_names`)."""
    parsed = SegmentName.parse(name)
    return None if parsed is None else parsed.pid


def remove_orphans(directory: str = SHM_DIR) -> list[str]:
    """Remove the regions in ``directory`` whose creating process no longer exists.

    Runs once per process, before its first region. A file whose creator is alive, or whose
    name carries no pid, is left alone. Returns the names removed.
    """
    removed = []
    for name in leftover_segments(directory):
        pid = creator_pid(name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a pid <= 0 means "not known yet": True)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
