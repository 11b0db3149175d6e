"""The table of transports: what the coordinator, the choice, the ranks and the CLI loop over.

The built-ins are listed by dotted path (``BUILTIN_TRANSPORTS``, ``BUILTIN_MODES``) and
imported only when first used: :func:`get` loads the one asked for, :func:`transports`
and :func:`auto_candidates` load them all (``auto`` weighs every candidate). A plug-in of
another package is registered with :func:`register` in the driver (the process that
builds the WeightSync), or through the ``weightsync.transports`` entry-point group (each
entry point names a :class:`Transport` or :class:`Mode` object), loaded on first use.
Nothing else needs it: every setup step carries its plug-in to the party that runs it.
Call order::

    register(MY_TRANSPORT)                       # once, before WeightSync(...)
    WeightSync(trainer, workers, transport={"w0": "mine", "w1": "auto"})
"""

from __future__ import annotations

import importlib
import logging
import threading
from importlib.metadata import entry_points

from weightsync.core.plugin import Mode, Plugin, Transport
from weightsync.core.wire.errors import SettingsError

log = logging.getLogger("weightsync")
ENTRY_POINT_GROUP = "weightsync.transports"

#: The built-in transports, in registration order: name -> "module:attribute".
BUILTIN_TRANSPORTS = {
    "broadcast": "weightsync.transports.broadcast.plugin:BROADCAST",
    "ipc": "weightsync.transports.ipc.plugin:IPC",
    "rank-ipc": "weightsync.transports.rank_ipc.plugin:RANK_IPC",
    "direct": "weightsync.transports.direct.plugin:DIRECT",
    "owners": "weightsync.transports.owners.plugin:OWNERS",
    "owner-writes": "weightsync.transports.owner_writes.plugin:OWNER_WRITES",
}
#: The built-in modes: name -> "module:attribute".
BUILTIN_MODES = {"push": "weightsync.transports.push.plugin:PUSH"}

_lock = threading.Lock()
# A value is the plug-in, or the dotted path of a built-in not imported yet.
_transports: dict[str, Transport | str] = dict(BUILTIN_TRANSPORTS)
_modes: dict[str, Mode | str] = dict(BUILTIN_MODES)
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


def _imported(name: str, path: str, kind: type[Plugin]) -> Plugin:
    """The object ``path`` ("module:attribute") names, checked to be the ``kind`` ``name``."""
    module, _, attribute = path.partition(":")
    plugin = getattr(importlib.import_module(module), attribute)
    if not isinstance(plugin, kind) or plugin.name != name:
        raise SettingsError(f"{path} is not the {kind.__name__} {name!r} the registry lists (got {plugin!r})")
    return plugin


def _load(table: dict[str, Transport | str] | dict[str, Mode | str], name: str, kind: type[Plugin]) -> Plugin | None:
    """The plug-in ``name`` of ``table``, imported on first use; None when not registered."""
    with _lock:
        found = table.get(name)
    if not isinstance(found, str):
        return found
    plugin = _imported(name, found, kind)  # outside the lock: an import may take long
    with _lock:
        if table.get(name) == found:  # neither replaced nor removed meanwhile
            table[name] = plugin  # type: ignore[assignment]
        return table.get(name)  # type: ignore[return-value]


def names() -> list[str]:
    """Every registered transport's name, in registration order (imports none)."""
    _load_entry_points()
    with _lock:
        return list(_transports)


def transports() -> list[Transport]:
    """Every registered transport, in registration order (the built-ins first); imports them all."""
    loaded = [_load(_transports, name, Transport) for name in names()]
    return [t for t in loaded if isinstance(t, Transport)]


def get(name: str) -> Transport:
    """The transport ``name``, imported on first use; refuses an unknown one, listing what is registered."""
    _load_entry_points()
    found = _load(_transports, name, Transport)
    if not isinstance(found, Transport):
        raise SettingsError(f"no transport named {name!r}; registered: {', '.join(names())}")
    return found


def mode(name: str) -> Mode:
    """The mode ``name``, imported on first use; refuses an unknown one."""
    _load_entry_points()
    found = _load(_modes, name, Mode)
    if not isinstance(found, Mode):
        with _lock:
            known = sorted(_modes)
        raise SettingsError(f"no mode named {name!r}; registered modes: {known}")
    return found


def auto_candidates() -> list[Transport]:
    """The transports ``auto`` may pick, best first."""
    ranked = [t for t in transports() if t.auto_rank is not None]
    return sorted(ranked, key=lambda t: t.auto_rank)  # type: ignore[arg-type, return-value]
