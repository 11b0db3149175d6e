"""The broadcast transport: trainer and workers on different devices or nodes, over one gloo or NCCL group."""
