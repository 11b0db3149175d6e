"""The Ray-free core: the endpoints and what they share, above the wire contract and the mechanisms.

Everything in this folder runs in one process, on CPU, without a cluster, and imports no
Ray (tests/test_structure.py checks the folder). Its first layer, ``wire/`` (what crosses a
process boundary: Manifest, messages, outcomes, errors), sits below
:mod:`weightsync.mechanisms` (how bytes and signals cross processes); the rest of the core
sits above both, and below the transports (docs/architecture.md draws the layers)::

    packing              chunk packing into buffers, unpacking into views, checksums
    halves               the transport interface: SendHalf, ReceiveHalf, Landing, Sources
    plugin, registry     the plug-in contract; the table of transports, by dotted path
    choice, placement    which transport can serve a worker, from where the two live
    sender, receiver     the two endpoints (the receiver holds the worker's state machine)
    sinks                where a worker's tensors land
    lora/                syncing only a PEFT adapter: the trainer's source, the workers' sinks
    sharded, gathering, riders, owned_plan, dtensors    a sharded trainer rank as a source
    checking, policy     checksum comparisons; the one failure policy
    local                a plug-in's setup run in one process
"""
