"""kvoffloadd: the node-local KV-cache offload daemon.

Layers, lowest first; a module imports only from its own layer or below
(``tests/unit/test_layout.py`` checks every import, lazy and type-only ones too):

1. ``trust``, ``ledger``, ``loopthread``: checks on what was on the node before us;
   what peers hold; which thread is the loop's.
2. ``region``: the shared-memory segment, its tables, extents and slots.
3. ``index``: per-namespace metadata (blocks, policies, leases, graves, event feeds).
4. ``config``, ``access``: the configuration and who may do what.
5. ``copies``: moving bytes between engines' caches and the region (CPU, memfd, GPU).
6. ``tiers``: secondary tiers below the region and the cascade/promotion between them.
7. ``service``: sessions and request handlers; owns namespaces, workers and budgets.
8. ``server``: the event loop and everything at the edge (sockets, HTTP, systemd).
9. ``main``: the command line, wiring the layers together; ``configdoc``: the
   configuration reference and example file, generated from ``config``, ``access``
   and the command line (``make docs``).

One thread, the loop's, owns all metadata (invariant: no locks around it); copier,
pinning, pre-fault and tier threads move bytes and hand results back through wake-up
descriptors.
"""

from kvoffload.version import __version__

__all__ = ["__version__"]
