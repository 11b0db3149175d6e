"""The rank-ipc transport: every trainer rank feeds, over ipc, the part of a worker on its device."""
