"""The built-in transports, one folder each: its plug-in, its two halves, its own messages.

``<name>/plugin.py`` declares the one object the registry knows it by (a
:class:`~weightsync.core.plugin.Transport`, or for push a :class:`~weightsync.core.plugin.Mode`),
``<name>/halves.py`` the trainer's and the worker's half (see :mod:`weightsync.core.halves`;
a long half lives in a module of its own, which ``halves.py`` names),
``<name>/messages.py`` the setup messages only it sends. :mod:`weightsync.core.registry`
lists them by dotted path and imports one when it is first used; nothing outside this
folder imports them. A transport that builds on another (owners on broadcast, owner
writes on direct, rank-ipc on ipc) imports that one's modules; the mechanisms they
share live in :mod:`weightsync.mechanisms`.
"""
