"""Sessions and request handlers: what each message does to the daemon's state.

Rules:
- Loop thread only. ``service.Service.handle`` dispatches one request; a client's
  mistake raises ``KVOffloadError`` and changes nothing; a one-way request that fails
  becomes a pushed notice.
- Whatever a peer makes the daemon hold is charged before it is held (``ledger``) and
  released when the peer leaves (invariant 5).
- Copies are validated in full here (``transfers``) before any address reaches
  ``kvoffloadd.copies`` (invariant 4); how a job ends is ``completions``.
- Engines' per-step batches and the pushes they get back live in ``engines``; the
  namespace table and the region's share-out in ``namespaces``; which connections
  have which namespace open, and what opening, leaving and losing one hold and
  release, in ``membership``; statistics are one pure function over per-component
  records (``stats``).
"""
