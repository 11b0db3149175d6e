"""The broadcast transport's setup message (the owner groups' too): which group to join."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.core.wire.fields import is_int, require


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """A broadcast group to join: rendezvous address and this rank (the timeout is the
    session's)."""

    name: str
    store_host: str
    store_port: int
    rank: int
    world_size: int
    backend: str
    nccl_id: bytes | None = None
    #: Every rank's party name, in rank order (rank 0 is the serving trainer party).
    members: tuple[str, ...] = ()
    #: The address this rank's gloo sockets listen on (its own node's; "" means store_host).
    bind_host: str = ""

    def __post_init__(self) -> None:
        require(
            len(self.members) == self.world_size and all(isinstance(m, str) and m for m in self.members),
            f"a group of {self.world_size} ranks needs {self.world_size} member names, got {self.members!r}",
        )
        require(self.backend in ("gloo", "nccl"), f"broadcast backend must be gloo or nccl, got {self.backend!r}")
        require(is_int(self.world_size) and self.world_size >= 2, f"world_size must be >= 2, got {self.world_size}")
        require(
            is_int(self.rank) and 0 <= self.rank < self.world_size,
            f"rank {self.rank} out of range for a world of {self.world_size}",
        )
        require(0 < self.store_port < 65536, f"store port {self.store_port} out of range")
        require(self.backend != "nccl" or isinstance(self.nccl_id, bytes), "an NCCL group needs the unique id as bytes")
