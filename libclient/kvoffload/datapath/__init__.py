"""How blocks lie in slots and in the region, and the copies that move them.

Rules:
- Shared by the client and the daemon: pure planning and copying, no sockets, no
  daemon state. The daemon trusts a plan only after validating it (``copyplan``);
  ``runs`` builds a validated transfer's merged copy runs and checks nothing.
- ``regionfmt`` is the region's on-memory format; a change to it is a format change
  (the daemon refuses a kept region of another format).
- Copies of many small runs go through ``memruns`` (strided groups, GIL released).
"""
