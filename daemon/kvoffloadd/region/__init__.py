"""The region: one shared-memory segment of KV blocks, its tables and its share-out.

Rules:
- The segment's format is ``kvoffload.datapath.regionfmt`` (shared with trusted
  client-copy workers); only the loop thread writes its tables.
- Nothing found under a region's name is trusted: a segment is adopted only if it is
  ours, private, whole and of today's format and geometry (``segment``,
  ``regionstate``), and every record read back is validated before use (``recovery``).
- Extents belong to one namespace or to nobody; slots are cut from a namespace's
  extents (``allocator``); a slot with a copy running is never reused.
- Pre-faulting and page-locking run on their own threads, never on the loop.
- Imports only ``trust`` from the daemon (and ``kvoffload.datapath``).
"""
