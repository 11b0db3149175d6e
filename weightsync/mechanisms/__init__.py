"""The mechanisms the transports share: how bytes and signals cross processes, not what a sync is.

Shared memory and CUDA IPC regions (:mod:`.shm`, :mod:`.cuda_ipc`, :mod:`.regions`), the
control blocks colocated parties meet on (:mod:`.control`), push mode's doorbell and
mailbox (:mod:`.doorbell`, :mod:`.mailbox`), the gloo and NCCL communicators
(:mod:`.gloo`, :mod:`.nccl`) and the groups over them that the packed-tensor drop-in uses
(:mod:`.groups`), the ports of listeners that other processes open (:mod:`.ports`), CUDA
streams (:mod:`.streams`) and the batched copy kernel (:mod:`.batched_copy`). They import
the wire contract (:mod:`weightsync.core.wire`) and nothing else of weightsync: no
transport, no endpoint, no Ray.
"""
