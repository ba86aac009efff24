"""The edge: the event loop, sockets, the HTTP endpoint, systemd and log format.

Rules:
- ``server.Server`` is the only event loop: it reads frames (with SCM_RIGHTS
  descriptors), hands requests to the service within each turn's budget, and writes
  replies and pushes. It owns no metadata rules. Beside it: ``admission``
  (connections accepted, refused, dropped, and what they held released), ``clients``
  (one connection's state and what its socket is charged in the ledger), ``output``
  (replies written out, event feeds pushed), ``ready`` (a turn's reads shared out
  among uids), ``listener`` (the control socket and its peers' credentials),
  ``turns`` (the fair queue of work), ``slowturns`` (slow turns told),
  ``heartbeat`` (once per cron period: the stats snapshot published, systemd told
  the progress and that the loop turns).
- A protocol error closes that connection only (invariant 6); an ``AssertionError``
  is a broken invariant and stops the daemon with its stats logged.
- The metrics/health endpoint runs on its own thread and serves a snapshot the loop
  publishes once per cron tick; no peer can keep the probes from answering.
"""
