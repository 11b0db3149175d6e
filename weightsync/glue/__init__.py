"""The Ray glue: the actors and mixins that host the endpoints, and the coordinator.

Ray is imported here and above, never in :mod:`weightsync.core`. The coordinator
(:class:`~weightsync.glue.coordinator.WeightSync`) drives the mixins' ``ws_*`` methods;
each party answers an :class:`~weightsync.core.wire.outcome.Outcome`.
"""
