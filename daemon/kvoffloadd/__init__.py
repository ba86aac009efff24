"""kvoffloadd: the node-local KV-cache offload daemon."""

__version__ = "0.1.0"
