"""The built-in transport plug-ins: how each transport is set up, chosen and driven.

One module per transport (:mod:`.broadcast`, :mod:`.ipc`, :mod:`.direct`) and one for push
mode (:mod:`.push`), each declaring one object (:class:`~weightsync.core.transport.plugin.Transport`
or :class:`~weightsync.core.transport.plugin.Mode`); :mod:`weightsync.core.registry` lists
them. The mechanisms they set up live in :mod:`weightsync.core.transport`.
"""
