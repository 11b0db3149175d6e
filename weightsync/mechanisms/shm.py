"""CPU export over POSIX shared memory: a ``/dev/shm`` file mapped by both processes.

``torch.from_file(path, shared=True)`` in each process is the simplest export that works
between Ray actors (torch's ``file_descriptor`` sharing strategy needs an authkey they do
not share). The producer creates the file (owner-only); consumers map it once. Once every
consumer has mapped it, :meth:`ShmRegion.unlink` removes the name while the mappings stay
valid, so nothing is left in ``/dev/shm`` even if a process is killed later.

A consumer maps only what a handle may name (:func:`map_shm`): a weightsync region's name
directly in ``/dev/shm`` (:mod:`weightsync.core.wire.shm_names`), a regular file of this
user, not a link; anything else is refused by path before it is opened.

A process killed between creating a region and unlinking it leaves its file behind; the
name carries the creator's pid and pid namespace, so every region made on this host first
removes the files whose creator is gone (:func:`remove_orphans`): only this user's files
of this pid namespace, since a pid means nothing in another one (a container sharing
``/dev/shm``).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import weakref

import torch

from weightsync.core.wire.errors import ExportNotFound, ForeignPath, SettingsError
from weightsync.core.wire.messages import ShmHandle
from weightsync.core.wire.shm_names import SHM_DIR, SHM_PREFIX, SegmentName, confined_path, pid_namespace


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check_size(nbytes: int, tag: str) -> None:
    """Refuse a size that is not one, or that ``/dev/shm`` cannot hold, before any file exists
    (tmpfs grants any ``ftruncate`` up to its limit and fails the write that does not fit)."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise SettingsError(f"a shared-memory region ({tag}) needs a size in bytes, got {nbytes!r}")
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise SettingsError(
            f"a shared-memory region ({tag}) of {nbytes} bytes does not fit in {SHM_DIR}, which has {free} bytes "
            "free: lower buffer_bytes (or buffer_size_bytes), or make /dev/shm larger"
        )


class ShmRegion:
    """A producer-owned ``/dev/shm`` region of ``nbytes`` bytes, created and mapped once."""

    def __init__(self, nbytes: int, tag: str = "buf") -> None:
        _check_size(nbytes, tag)
        remove_orphans()
        name = SegmentName.fresh(tag)
        self.session = name.session
        self.path = os.path.join(SHM_DIR, str(name))
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.ftruncate(fd, max(nbytes, 1))
            finally:
                os.close(fd)
            self.tensor = torch.from_file(self.path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
        except BaseException:
            _unlink_quietly(self.path)
            raise
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        self.nbytes = nbytes

    def handle(self) -> ShmHandle:
        return ShmHandle(path=self.path, nbytes=self.nbytes, hostname=socket.gethostname(), session=self.session)

    def unlink(self) -> None:
        """Remove the name; existing mappings (ours and consumers') stay valid."""
        self._finalizer()

    def close(self) -> None:
        self.unlink()
        del self.tensor


def map_shm(handle: ShmHandle) -> torch.Tensor:
    """Map a producer's region in this process (the caller keeps it for the session).

    The handle may have crossed a process boundary, so its path is checked again here (an
    unpickled handle skips its own checks): a weightsync region directly in ``/dev/shm``,
    a regular file owned by this user, opened without following a link.
    """
    confined_path(handle.path, f"shared-memory export (session {handle.session})")
    if handle.hostname != socket.gethostname():
        raise ExportNotFound(
            f"shared-memory export {handle.path} lives on host {handle.hostname!r}, this is "
            f"{socket.gethostname()!r}: the ipc transport needs trainer and worker on one node "
            "(use transport='broadcast' across nodes)"
        )
    try:
        fd = os.open(handle.path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ExportNotFound(
            f"shared-memory export {handle.path} (session {handle.session}) does not exist: "
            "it was closed, or belongs to a previous session: export it again (with a WeightSync, run "
            "setup() again; with the packed IPC functions, have the producer send a new handle)"
        ) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ForeignPath(f"shared-memory export {handle.path} is a symbolic link, not a region: refused") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ForeignPath(
                f"shared-memory export {handle.path} is not a regular file of this user (uid {info.st_uid}, "
                f"mode {stat.filemode(info.st_mode)}): refused"
            )
        size = max(handle.nbytes, 1)
        if info.st_size < size:
            raise ExportNotFound(
                f"shared-memory export {handle.path} holds {info.st_size} bytes, the handle says "
                f"{handle.nbytes}: a stale or foreign handle"
            )
        # The descriptor just checked, not the name again, is what gets mapped.
        source = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else handle.path
        return torch.from_file(source, shared=True, size=size, dtype=torch.uint8)[: handle.nbytes]
    finally:
        os.close(fd)


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


def remove_orphans(directory: str = SHM_DIR) -> list[str]:
    """Remove the regions in ``directory`` whose creating process no longer exists.

    Runs before every region this process creates, so a region left by a process killed
    between export and seal is gone at the next set-up on this host. Only regions of this
    user and of this pid namespace are judged: a creator in another namespace (another
    container sharing ``/dev/shm``) cannot be looked up from here, so its regions stay.
    Returns the names removed.
    """
    removed = []
    here = pid_namespace()
    uid = os.getuid()
    for name in leftover_segments(directory):
        parsed = SegmentName.parse(name)
        if parsed is None or parsed.pidns != here or parsed.pid == os.getpid() or pid_alive(parsed.pid):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != uid:
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


#: Where Linux shows each process's state (a zombie's included); absent elsewhere.
_PROC = os.path.isdir("/proc/self")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a pid <= 0 means "not known yet": True).

    A zombie is not alive: a killed process stays one until its parent reaps it, and for
    a Ray actor that parent is the raylet, which on a busy machine takes its time. The
    signal check alone (``kill(pid, 0)``) sees a zombie as alive, so a dead peer would be
    named only once reaped, or as timed out at the deadline.
    """
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` is a zombie, or gone since it was looked up (Linux; elsewhere False)."""
    if not _PROC:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            line = fh.read()
    except FileNotFoundError:
        return True  # reaped meanwhile
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")".
    state = line.rfind(b")") + 2
    return line[state : state + 1] == b"Z"
