"""The direct transport: a worker on the trainer's device holding plain tensors, written in one copy."""
