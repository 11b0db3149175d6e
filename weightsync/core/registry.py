"""The table of transports: what the coordinator, the choice, the ranks and the CLI loop over.

The built-ins (broadcast, ipc, direct) are registered when this module loads, and push
mode with them; a plug-in of another package is registered with :func:`register` in the
driver (the process that builds the WeightSync), or through the ``weightsync.transports``
entry-point group (each entry point names a :class:`Transport` or :class:`Mode` object),
loaded on first use. Nothing else needs it: every setup step carries its plug-in to the
party that runs it. Call order::

    register(MY_TRANSPORT)                       # once, before WeightSync(...)
    WeightSync(trainer, workers, transport={"w0": "mine", "w1": "auto"})
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import entry_points

from weightsync.core.plugins.broadcast import BROADCAST
from weightsync.core.plugins.direct import DIRECT
from weightsync.core.plugins.ipc import IPC
from weightsync.core.plugins.owned import OWNERS
from weightsync.core.plugins.owner_writes import OWNER_WRITES
from weightsync.core.plugins.push import PUSH
from weightsync.core.plugins.rank_ipc import RANK_IPC
from weightsync.core.transport.plugin import Mode, Plugin, Transport
from weightsync.core.wire.errors import SettingsError

log = logging.getLogger("weightsync")
ENTRY_POINT_GROUP = "weightsync.transports"

_lock = threading.Lock()
_transports: dict[str, Transport] = {}
_modes: dict[str, Mode] = {}
_entry_points_loaded = False


def register(plugin: Plugin, *, replace: bool = False) -> None:
    """Add ``plugin`` (a Transport or a Mode); a name already taken is refused unless ``replace``."""
    if not isinstance(plugin, (Transport, Mode)):
        raise SettingsError(f"register() takes a Transport or a Mode, got {type(plugin).__name__}")
    with _lock:
        taken = plugin.name in _transports or plugin.name in _modes or plugin.name == "auto"
        if taken and not replace:
            raise SettingsError(
                f"a transport or mode named {plugin.name!r} is already registered; pick another name "
                "(or pass replace=True to swap it)"
            )
        _transports.pop(plugin.name, None)
        _modes.pop(plugin.name, None)
        if isinstance(plugin, Transport):
            _transports[plugin.name] = plugin
        else:
            _modes[plugin.name] = plugin


def unregister(name: str) -> None:
    """Remove the plug-in ``name`` (the built-ins too: at the caller's risk)."""
    with _lock:
        known = sorted([*_transports, *_modes])
        if _transports.pop(name, None) is None and _modes.pop(name, None) is None:
            raise SettingsError(f"no transport or mode named {name!r} is registered; known: {known}")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        plugin = point.load()
        log.info("weightsync: transport plug-in %r from entry point %s", getattr(plugin, "name", "?"), point.value)
        register(plugin)


def transports() -> list[Transport]:
    """Every registered transport, in registration order (the built-ins first)."""
    _load_entry_points()
    with _lock:
        return list(_transports.values())


def names() -> list[str]:
    return [t.name for t in transports()]


def get(name: str) -> Transport:
    """The transport ``name``; refuses an unknown one, listing what is registered."""
    for transport in transports():
        if transport.name == name:
            return transport
    raise SettingsError(f"no transport named {name!r}; registered: {', '.join(names())}")


def mode(name: str) -> Mode:
    _load_entry_points()
    with _lock:
        found = _modes.get(name)
    if found is None:
        raise SettingsError(f"no mode named {name!r}; registered modes: {sorted(_modes)}")
    return found


def auto_candidates() -> list[Transport]:
    """The transports ``auto`` may pick, best first."""
    ranked = [t for t in transports() if t.auto_rank is not None]
    return sorted(ranked, key=lambda t: t.auto_rank)  # type: ignore[arg-type, return-value]


for _builtin in (BROADCAST, IPC, RANK_IPC, DIRECT, OWNERS, OWNER_WRITES, PUSH):
    register(_builtin)
