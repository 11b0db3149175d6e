"""Comparisons of per-tensor checksums: ``WeightSync.verify``'s, and a verified sync's commit.

Both compare what each worker's destination holds with one reference, the trainer's
checksums (rank 0's, for the ranks of a sharded trainer), so a worker fed by a rank whose
replica of a tensor differs from rank 0's is caught and the ranks are named. Pure
functions of the checksums, so they need no Ray and no actor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from weightsync.core.wire.errors import ChecksumMismatch, VerificationError
from weightsync.core.wire.messages import ReceiveResult
from weightsync.core.wire.outcome import Outcome


def compare_checksums(trainer: Sequence[Outcome], workers: Mapping[str, Outcome], names: Sequence[str]) -> str:
    """The digest of the trainer's checksums; :class:`VerificationError` naming, per worker,
    the first tensor that differs (or why it could not be checked).

    ``trainer``: the outcome of every trainer rank, rank 0 first (all ranks take part in
    the gathers; rank 0's checksums are the reference).
    """
    bad = [o for o in trainer if not o.ok]
    if bad:
        raise VerificationError(
            f"the trainer could not compute its checksums: {bad[0].line()}", {bad[0].party: bad[0].message}
        )
    expected: list[int] = trainer[0].value
    mismatches: dict[str, str] = {}
    lines: list[str] = []
    for rank in trainer[1:]:
        differs = [names[i] for i, (a, b) in enumerate(zip(rank.value, expected)) if a != b]
        if differs:
            mismatches[rank.party] = differs[0]
            lines.append(
                f"{rank.party}: its {_few(differs)} differ(s) from {trainer[0].party}'s (the reference): the "
                "trainer's ranks hold different bytes for a replicated tensor; the workers it serves got those"
            )
    for name, o in workers.items():
        if not o.ok or o.value is None:
            why = o.line() if not o.ok else "it has received nothing yet in this session"
            mismatches[name] = f"could not be checked: {why}"
            lines.append(f"{name}: could not be checked: {why}")
            continue
        differs = [names[i] for i, (a, b) in enumerate(zip(o.value, expected)) if a != b]
        if differs:
            mismatches[name] = differs[0]
            lines.append(f"{name}: first differing tensor {differs[0]} ({len(differs)} differ)")
    if mismatches:
        text = "\n  ".join(sorted(lines))
        raise VerificationError(f"weights differ from the trainer's:\n  {text}", mismatches)
    return hashlib.sha256(",".join(map(str, expected)).encode()).hexdigest()


def _few(names: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return (
        f"{len(names)} tensors ({shown}, ...)" if len(names) > most else f"tensor {shown}" if len(names) == 1 else shown
    )


def check_destination(
    worker: str, names: Sequence[str], held: Sequence[int] | None, sent: Outcome, reference: Outcome
) -> None:
    """A verified commit's last check: ``held`` (per tensor, what ``worker``'s sink holds
    after loading) against ``reference``'s checksums of what it sent. A difference where
    ``sent`` (the worker's own server) already differs from ``reference`` is the trainer's
    replicas diverging (blamed on the server); any other is bytes that did not land in the
    worker's weights (blamed on the worker). Raises :class:`ChecksumMismatch` naming them."""
    expected: list[int] = reference.value.tensor_checksums
    served: list[int] = sent.value.tensor_checksums
    if held is None or len(held) != len(names) or len(expected) != len(names):
        raise ChecksumMismatch(
            f"{worker}: verify needs one checksum per tensor ({len(names)}) of what the sink holds and of what "
            f"{reference.party} sent; got {'none' if held is None else len(held)} and {len(expected)}",
            blames=[worker],
        )
    bad = [i for i, (a, b) in enumerate(zip(held, expected)) if a != b]
    if not bad:
        return
    if sent.party != reference.party and len(served) == len(names):
        diverged = [names[i] for i in bad if served[i] != expected[i]]
        if diverged:
            raise ChecksumMismatch(
                f"{worker}: its {_few(diverged)} came from {sent.party}, whose bytes differ from "
                f"{reference.party}'s (the reference): the trainer's ranks hold different replicas of a "
                "replicated tensor; version not taken. Make the ranks agree (broadcast it from rank 0) and sync again",
                blames=[sent.party],
            )
    first = names[bad[0]]
    raise ChecksumMismatch(
        f"{worker}: after loading, its {_few([names[i] for i in bad])} hold(s) bytes that differ from what "
        f"{reference.party} sent (first: {first}): the bytes did not land in the worker's weights (a sink that "
        "writes elsewhere, or tensors without storage); version not taken",
        blames=[worker],
    )


def check_commit(
    worker: str, names: Sequence[str], got: ReceiveResult, sent: Sequence[Outcome], reference: Outcome | None
) -> None:
    """A verified commit's checks of ``worker``'s receive ``got``: every chunk's checksum
    against its senders' (``sent``, the parties whose bytes it received, theirs put together
    in rank order), then every tensor its sink holds against ``reference`` (the trainer, or
    rank 0 of a sharded one; see :func:`check_destination`). Raises ChecksumMismatch."""
    expected = [c for o in sent for c in o.value.checksums.get(got.transport, [])]
    bad = [i for i, (a, b) in enumerate(zip(got.checksums, expected)) if a != b]
    if bad or len(got.checksums) != len(expected):
        which = ", ".join(f"chunk {i}" for i in bad) or f"{len(got.checksums)} checksums for {len(expected)} chunks"
        raise ChecksumMismatch(f"{worker}: checksum mismatch ({which}): bytes corrupted in transit")
    check_destination(worker, names, got.held, _diverging(sent, reference), reference or sent[0])


def _diverging(sent: Sequence[Outcome], reference: Outcome | None) -> Outcome:
    """Of the senders serving a worker, the one to blame for bytes that differ from
    ``reference``: the first whose own per-tensor checksums differ from it (a rank holding
    another replica), else the first."""
    if reference is not None:
        for o in sent:
            if o.value.tensor_checksums != reference.value.tensor_checksums:
                return o
    return sent[0]
