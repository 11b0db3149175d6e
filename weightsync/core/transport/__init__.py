"""Transports: one module per mechanism, none of them importing Ray."""
