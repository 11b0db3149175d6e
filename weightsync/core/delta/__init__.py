"""Delta syncs: send only the elements whose bit patterns changed since the last sync.

A layer between the sender's walk and the transports, not a transport: the trainer
compares each tensor's wire bytes with the base (what it last sent), and a transport that
carries deltas moves, instead of the dense bytes, a small header (per tensor: unchanged,
dense, or the count of changed elements as indices or a bitmask) and then the payloads,
planned from that header with the Manifest's buffer settings on both sides. No Ray, no
transport here. Bottom up::

    encoding      kinds, codes, the payload layout of one tensor
    header        the per-sync header and the payload plan both sides derive from it
    cpu_kernels   the CPU loops (numba_loops, when numba is installed) and their threads
    cuda_kernels  the GPU kernels (CuPy)
    cpu_diff      one tensor's compare on a CPU, in ranges (and the sync's give-up)
    device_diff   one tensor's compare on a GPU (kernels) or with torch ops
    diff          a sync's tensors against the base, in order (updates the base)
    apply         the worker's write of one tensor's payload
    wire_copy     a load_weights sink's copy of the wire bytes
    encoder       the trainer's base and one sync's encoding
    sending       the sender's part: the encoder, what a chunked transport sends
    landing       the worker's part: the header read, the payloads landed
"""
