"""Per-namespace metadata: which key lives in which slot, and in what state.

Rules:
- vLLM's offloading-manager semantics (``storeindex``): a block is visible only once
  its store completed whole; pinned and written blocks are never evicted; eviction for
  one store is all or nothing.
- Engines' one-way batches (claims, pins, commits) are lenient: nothing they send is
  an error that could reach the engine (``index``, over ``loads``: pins and loads,
  over ``storeindex``: stores).
- Leases, graves and event feeds are bounded and charged to whoever made them
  (``leases``, ``graves``, ``events``, ``kvoffloadd.ledger``).
- Lookups probe the ready keys where the request's packed field lies, in C where it
  was built (``keyset``), each namespace's keys hashed under a secret of its own.
- A policy holds one ``Block`` per key, a C type where it was built (``policies``);
  the Python class has the same attributes.
- Loop thread only, no locks; no I/O. Imports ``region.allocator`` and ``ledger``.
"""
