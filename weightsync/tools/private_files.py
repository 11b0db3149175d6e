"""Directories and files that only their owner may use: made fresh owner-only, refused otherwise.

The local head's directory lives under ``/tmp`` by default, where any local user can create
a name before we do. So a name found there is never trusted for its name alone:

* a directory must be a real directory (not a symlink), owned by this user, with no group
  or other permission bits (``0700`` or narrower); one that is not is refused by name, never
  reused or repaired, since whoever made it may already hold files or handles inside it;
* a file is read only when it is a regular file with the same owner and modes (``0600``),
  opened with ``O_NOFOLLOW``, and checked on the open descriptor (``fstat``), so a symlink or a
  swapped file cannot redirect the read (a token read this way is what gets sent to a server);
* a file is written fresh: an existing regular file of ours is removed and a new one created
  with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode ``0600``; a symlink, a directory or anything
  else in its place is refused, and the file it might point to is never touched.

``uid`` parameters default to this process's user; tests pass another one to see the owner
check refuse without needing a second account.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: Permission bits that must be clear on what we create or reuse: nothing for group or other.
_SHARED_BITS = 0o077


class UnsafePathError(RuntimeError):
    """A directory or file weightsync would use is not private to this user; the message
    names it, says what was found and what to do."""


def _problem(st: os.stat_result, uid: int, kind: str, want_kind: str) -> str | None:
    if kind != want_kind:
        return f"is a {kind}, expected a {want_kind}"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, expected uid {uid} (this user)"
    if st.st_mode & _SHARED_BITS:
        wanted = "0700" if want_kind == "directory" else "0600"
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, which lets others in (expected {wanted})"
    return None


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if stat.S_ISDIR(st.st_mode):
        return "directory"
    if stat.S_ISREG(st.st_mode):
        return "regular file"
    return "special file"


def check_directory(path: Path, uid: int | None = None, hint: str = "") -> bool:
    """False when ``path`` does not exist; True when it is a private directory of ``uid``;
    raises :class:`UnsafePathError` naming it otherwise."""
    uid = os.getuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    problem = _problem(st, uid, _kind(st), "directory")
    if problem:
        raise UnsafePathError(
            f"{path} {problem}; weightsync keeps its token and logs there and will not use a directory that "
            f"someone else could have made or can enter. Remove it (rm -rf {path}) if it is yours and stale, "
            f"or use another directory{hint}"
        )
    return True


def make_directory(path: Path, uid: int | None = None, hint: str = "") -> None:
    """Create ``path`` with mode 0700 (its missing parents with the default mode), or accept an
    existing one that :func:`check_directory` finds private; refuse anything else by name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # made earlier, by us or by someone else: the check below tells which
    check_directory(path, uid, hint)


def read_file(path: Path, uid: int | None = None) -> bytes | None:
    """The bytes of the private file ``path``; None when it does not exist. A symlink, a
    non-regular file, another owner or group/other mode bits raise :class:`UnsafePathError`."""
    uid = os.getuid() if uid is None else uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink; ENXIO and friends: a socket or fifo
        st = os.lstat(path)
        raise UnsafePathError(
            f"{path} {_problem(st, uid, _kind(st), 'regular file') or 'cannot be opened'} ({exc.strerror}); "
            "weightsync reads it only as a regular file of yours with mode 0600: remove it or fix its mode"
        ) from exc
    try:
        st = os.fstat(fd)
        problem = _problem(st, uid, _kind(st), "regular file")
        if problem:
            raise UnsafePathError(
                f"{path} {problem}; weightsync reads it only as a regular file of yours with mode 0600 "
                f"(chmod 600 {path} if it is yours)"
            )
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def create_file(path: Path, uid: int | None = None) -> int:
    """A new, empty file at ``path`` with mode 0600, open for writing; returns its descriptor.

    An older regular file of ``uid`` at that name is removed first (so the new one is fresh,
    whatever mode the old one had); a symlink, directory, special file or another user's
    file is refused by name and left as it is.
    """
    uid = os.getuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        kind = _kind(st)
        if kind != "regular file" or st.st_uid != uid:
            raise UnsafePathError(
                f"{path} {_problem(st, uid, kind, 'regular file')}; weightsync will not write through it. "
                f"Remove it (rm -rf {path}) and run the command again"
            )
        os.unlink(path)
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError as exc:
        raise UnsafePathError(
            f"{path} appeared while weightsync was replacing it; another process writes into this directory. "
            "Stop it, or use another directory"
        ) from exc


def write_file(path: Path, data: bytes, uid: int | None = None) -> None:
    """Write ``data`` to a fresh 0600 file at ``path`` (see :func:`create_file`)."""
    fd = create_file(path, uid)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
