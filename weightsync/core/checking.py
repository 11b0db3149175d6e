"""``WeightSync.verify``'s comparison: every worker's per-tensor checksums against the trainer's.

A pure function of the checksum outcomes (one per party), so it needs no Ray and no actor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from weightsync.core.wire.errors import VerificationError
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
