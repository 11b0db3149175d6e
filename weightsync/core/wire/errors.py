"""Every error weightsync raises on purpose, in one place.

Each class says, as data, how the coordinator should read it: ``consequence`` is True for
errors a party raises because another party failed first (a peer aborted, a peer left the
group, a wait for a peer ran out), and ``blames`` names the parties an error points at (the
worker that was late, the side that aborted). The coordinator assigns blame from these two
attributes and from which calls died or never answered; it never reads message text.

This module imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from weightsync.core.wire.outcome import Outcome


class WeightSyncError(RuntimeError):
    """Base class of every error weightsync raises on purpose.

    ``blames``: the parties (``"trainer"`` or a worker name) this failure points at.
    """

    consequence: ClassVar[bool] = False

    def __init__(self, message: str = "", *, blames: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.blames: tuple[str, ...] = tuple(blames)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep ``blames`` when Ray pickles the error across processes.
        return (_rebuild, (type(self), str(self), self.blames, self.__dict__))


def _rebuild(cls: type[WeightSyncError], message: str, blames: tuple[str, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    WeightSyncError.__init__(error, message, blames=blames)
    error.__dict__.update(state)
    return error


class SettingsError(WeightSyncError, ValueError):
    """A setting outside what weightsync can run with; the message names the setting."""


class UnsupportedDtypeError(WeightSyncError, ValueError):
    """A dtype name or dtype outside the allow-list."""


class ManifestError(WeightSyncError, ValueError):
    """A Manifest that is malformed, or that does not match a model."""


class ModelChangedError(ManifestError):
    """A model's tensors changed (added, removed, reshaped, re-typed) since setup.

    Nothing was sent: run ``WeightSync.setup()`` again once both sides hold the new model.
    """


class VersionError(WeightSyncError, ValueError):
    """A sync asked for a version older than the one a worker holds."""


class SyncInFlight(WeightSyncError):
    """A sync reached a worker whose previous sync was still in flight (received, its commit
    or swap not done); refused, so two syncs never mix."""


class ChecksumMismatch(WeightSyncError):
    """Bytes a worker received differ from what the trainer sent."""


class ExportNotFound(WeightSyncError, FileNotFoundError):
    """An export handle names a region that no longer exists (or is on another host)."""


class ForeignPath(WeightSyncError, ValueError):
    """A path received from another process that is not one of weightsync's own regions."""


class DeviceMismatch(WeightSyncError, ValueError):
    """A CUDA IPC handle for a GPU this process cannot see."""


class TransferTimeout(WeightSyncError, TimeoutError):
    """A wait inside a transfer ran past its deadline; ``blames`` names whom it waited for."""

    consequence = True


class StreamTimeout(WeightSyncError, TimeoutError):
    """This process's own device work (a copy, a pack, an unpack) did not finish in time:
    a failure of the party that raised it, not a consequence of a peer's."""


class PeerAborted(WeightSyncError):
    """Another party of the transfer failed, or its process ended, mid-transfer."""

    consequence = True


class SessionTornDown(WeightSyncError):
    """The session a call ran in was torn down meanwhile (``close()``, a new setup, a failed
    sync, ``remove_worker()``), from another thread or by another coordinator."""


class ClosedError(WeightSyncError):
    """A WeightSync used after ``close()`` (its ``with`` block ended); ``setup()`` opens it again."""


class ConcurrentSyncError(WeightSyncError):
    """Two WeightSyncs asked one sharded trainer's ranks to sync (or verify) at the same
    moment. Its ranks gather together on the trainer's own process group, one sync at a
    time, so the later one is refused before any byte moved (or, when the ranks found
    themselves in different WeightSyncs' syncs, both are): the group is left intact."""


class TransferError(WeightSyncError):
    """A collective failed because a peer left the group or crashed."""

    consequence = True


class _CoordinatorError(WeightSyncError):
    """An error the coordinator raises from every party's outcome of a call."""

    def __init__(
        self, message: str, outcomes: Mapping[str, Outcome], culprits: Sequence[str], dead: Sequence[str] = ()
    ) -> None:
        super().__init__(message, blames=culprits)
        self.outcomes: dict[str, Outcome] = dict(outcomes)
        self.culprits: list[str] = list(culprits)
        #: The parties whose actor died (dead workers are dropped from the WeightSync).
        self.dead: list[str] = list(dead)

    @property
    def failures(self) -> dict[str, str]:
        """Each failing party's message (for display; decide nothing from it)."""
        return {party: o.message for party, o in self.outcomes.items() if not o.ok}


class SetupError(_CoordinatorError):
    """Setup refused: a handshake mismatch, an unusable transport or a dead party, named
    (``dead``: parties whose actor died; dead workers are dropped, reported here)."""


class SyncError(_CoordinatorError):
    """A sync failed.

    ``outcomes``: every party's outcome; ``culprits``: the parties blamed; ``dead``: workers
    and the trainer whose actor died (dead workers are dropped from the WeightSync, reported
    here); ``held``: each live worker's (version, state) after the failure; ``waiting``:
    the workers that could not be asked for theirs, each with the parties whose answers its
    commit still waits for (it settles once they answer or die; ``ws_status()`` then says).
    """

    def __init__(
        self,
        message: str,
        outcomes: Mapping[str, Outcome],
        culprits: Sequence[str],
        dead: Sequence[str] = (),
        held: Mapping[str, tuple[int | None, str]] | None = None,
        waiting: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(message, outcomes, culprits, dead)
        self.held: dict[str, tuple[int | None, str]] = dict(held or {})
        self.waiting: dict[str, list[str]] = {name: list(parties) for name, parties in (waiting or {}).items()}


class VerificationError(WeightSyncError):
    """A worker's weights differ from the trainer's; ``mismatches`` maps each worker to the
    first tensor that differs (or to why it could not be checked)."""

    def __init__(self, message: str, mismatches: Mapping[str, str]) -> None:
        super().__init__(message, blames=tuple(mismatches))
        self.mismatches: dict[str, str] = dict(mismatches)
