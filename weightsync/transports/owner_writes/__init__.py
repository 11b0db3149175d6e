"""The owner-writes transport: each rank of a sharded trainer writes its rows into a colocated worker."""
