"""The owners transport: each rank of a sharded trainer broadcasts the bytes it holds."""
