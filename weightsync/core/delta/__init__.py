"""Delta syncs: send only the elements whose bit patterns changed since the last sync.

A layer between the sender's walk and the transports, not a transport: the trainer
compares each tensor's wire bytes with the base (what it last sent), and a transport that
carries deltas moves, instead of the dense bytes, a small header (per tensor: unchanged,
dense, or the count of changed elements as indices or a bitmask) and then the payloads,
planned from that header with the Manifest's buffer settings on both sides. No Ray, no
transport here. Bottom up::

    encoding     kinds, codes, the payload layout of one tensor
    diff         the trainer's compare-and-gather of one tensor (updates the base)
    apply        the worker's write of one tensor's payload
    cpu_kernels  the CPU loops (numba_loops, when numba is installed)
"""
