"""The region: one shared-memory segment of KV blocks, its tables and its share-out,
and bringing it up on the node (backing, placement, population, pinning, limits).

Rules:
- The segment's format is ``kvoffload.datapath.regionfmt`` (shared with trusted
  client-copy workers); only the loop thread writes its tables.
- Nothing found under a region's name is trusted: a segment is adopted only if it is
  ours, private, whole and of today's format and geometry (``segment``,
  ``regionstate``), and every record read back is validated before use (``recovery``).
- Extents belong to one namespace or to nobody (``allocator``); slots are cut from a
  namespace's extents (``slots``); a slot with a copy running is never reused, and no
  slot call costs the namespace's size. New extents
  are ready ones first, on the namespace's NUMA node where its GPUs share one
  (``placement``).
- A region never surprises its host: before a page is taken it must fit every limit
  that could kill the daemon later (``limits``, ``bringup``); its memory is placed by
  node (``placement``, ``topology``) and backed as configured (``backing``).
- Populating and page-locking run on their own threads, chunk by chunk, never on the
  loop, and call the kernel and the driver through ctypes, which frees the GIL
  (``populate``, ``pinning``, ``kernel``).
- Imports only ``trust`` from the daemon (and ``kvoffload.datapath`` and
  ``kvoffload.cuda``); the node is read under a root directory, so tests run it on
  fake sysfs trees.
"""
