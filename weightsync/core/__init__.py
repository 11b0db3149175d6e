"""The Ray-free core: the wire contract, packing, the transports and the endpoints.

Everything in this folder runs in one process, on CPU, without a cluster, and imports no
Ray (tests/test_structure.py checks the folder). Bottom up::

    wire/        what crosses a process boundary: Manifest, messages, outcomes, errors
    packing      chunk plans, pack into buffers, unpack into views
    transport/   one module per mechanism (broadcast, ipc, direct) and their shared pieces
    registry     the table of transports every layer above loops over
    session      what one set-up fixes for every half: manifest, names, deadlines
    policy       one failure policy: the parties' outcomes -> error, blame, what to settle
    sender, receiver, sharded, sinks, listener, pusher    the endpoints
"""
