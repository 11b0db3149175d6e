"""Drop-ins for other projects' APIs, on top of the core: vLLM's packed-tensor helpers
(public as :mod:`weightsync.packed_tensor`)."""
