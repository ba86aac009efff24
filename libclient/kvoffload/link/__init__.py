"""The connection under the client API: transport, the daemon's identity, channels,
and the keeper thread that replaces a lost connection.

Rules:
- A client talks only to a daemon whose identity the kernel vouches for (``peer``).
- The transport never raises into an engine for a daemon fault: a lost daemon is a
  ``DAEMON_UNAVAILABLE`` the API turns into misses (invariant 7).
- The keeper never holds the client's lock while it waits or connects; it knows the
  client only through ``keeper.Kept`` (no import of the API layer).
"""
