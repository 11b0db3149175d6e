"""The ipc transport: a worker on the trainer's device whose sink transforms tensors, fed through shared slots."""
