"""A party whose sync method ended before its side of the sync began tells its peers at once.

Each side's peers learn of its failures from the transport (abort words, the broadcast
agreement, a group abort), told by :meth:`WeightSender.send` and :meth:`WeightReceiver.receive`
before they raise. A party whose actor method never reached them (an override of
``ws_receive`` or ``ws_send`` that raised first, or answered by itself) tells nobody, and
its peers would wait their whole deadline for an announcement or a write that never comes,
although the coordinator knew the cause at once. So when such a method ends, its wrapper
(:func:`weightsync.glue.replies.on_board`) asks here, and a side that did not begin this
sync starts its halves for it and aborts them::

    ws_receive(call) ends -> abandon_receive(receiver, call): began? nothing; else
                             half.start(call), half.abort()  -> the trainer stops waiting
    ws_send(call) ends    -> abandon_send(sender, call):      the same for every half of it

Nothing is written either way, so the party's state stays what it was.
"""

from __future__ import annotations

from weightsync.core.halves import abort_each
from weightsync.core.ownership import foreign
from weightsync.core.receiver import WeightReceiver
from weightsync.core.sender import WeightSender
from weightsync.core.wire.messages import SyncCall


def abandon_receive(receiver: WeightReceiver, call: SyncCall) -> bool:
    """Abort ``receiver``'s half for ``call`` unless its receive began; True when it did.
    A call of another coordinator than the one holding the worker touches nothing."""
    half = receiver.active_half
    if half is None or receiver.began == (call.owner, call.seq) or foreign(receiver.owner, call.owner):
        return False
    receiver.began = (call.owner, call.seq)
    try:
        half.start(call)
    finally:
        abort_each([half], None)
    return True


def abandon_send(sender: WeightSender, call: SyncCall) -> bool:
    """Abort every half of ``sender`` that ``call`` drives unless its send began; True when it did."""
    if sender.began == (call.owner, call.seq) or foreign(sender.owner, call.owner) or not sender.halves:
        return False
    call = sender.resolve(call)
    try:
        sender.start_halves(call)
    finally:
        sender.abort_halves(call)
    return True
