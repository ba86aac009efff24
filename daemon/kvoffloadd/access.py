"""Who may connect, open which namespaces, and administer the daemon.

Rules:
- Identities come from the kernel (SO_PEERCRED on accept: pid, uid, primary gid) plus
  the peer's supplementary groups from ``/proc/<pid>/status``; nothing a client
  sends is trusted for identity.
- Connecting: with neither ``allow_uids`` nor ``allow_gids`` set, whoever can reach
  the socket may connect (the socket is 0660 in a 0750 directory, so that is the
  daemon's user and group). With either set, a peer must match one of them. The
  daemon's own uid and root always may.
- Namespaces: ``namespace_access`` rules are tried in order and the first whose glob
  ``pattern`` matches the namespace name decides: its ``uids``/``gids`` may read and
  write (store into) the namespace, its ``read_uids``/``read_gids`` only read it
  (look up, probe, load, follow its keys). A name no rule matches is refused once any
  rule exists. Without rules every peer may open, read and write every namespace.
- Administering (evict, reading the config): ``admin_uids`` (unset: root and the
  daemon's own uid) or ``admin_gids``.
- Mapping the region (client-copy workers, which copy their own caches and so can read
  and write every block of every namespace): ``client_copy_uids`` (unset: root and the
  daemon's own uid) or ``client_copy_gids``.
- Every refusal is a ``PERMISSION_DENIED`` reply and a warning in the log.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import msgspec


class NamespaceRule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Who may open the namespaces whose name matches ``pattern``."""

    # glob pattern of namespace names (rules are tried in order, the first match decides)
    # example: "team-a-*"
    pattern: str
    # uids that may open the matching namespaces
    # example: [1000]
    uids: list[int] = msgspec.field(default_factory=list)
    # groups whose members may open them (primary or supplementary gid)
    # example: [997]
    gids: list[int] = msgspec.field(default_factory=list)
    # uids that may only read the matching namespaces (look up, probe, load), not store
    # example: [1001]
    read_uids: list[int] = msgspec.field(default_factory=list)
    # groups whose members may only read them
    # example: [998]
    read_gids: list[int] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gids: frozenset[int]  # primary and supplementary


def peer_groups(pid: int, gid: int) -> frozenset[int]:
    """The peer's primary gid and, when readable, its supplementary groups."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass
    return frozenset(groups)


class AccessPolicy:
    def __init__(
        self,
        allow_uids: list[int] | None,
        allow_gids: list[int] | None,
        admin_uids: list[int] | None,
        admin_gids: list[int],
        namespace_rules: list[NamespaceRule],
        client_copy_uids: list[int] | None = None,
        client_copy_gids: list[int] | None = None,
    ) -> None:
        self._allow_uids = None if allow_uids is None else frozenset(allow_uids)
        self._allow_gids = None if allow_gids is None else frozenset(allow_gids)
        self._admin_uids = frozenset((0, os.getuid()) if admin_uids is None else admin_uids)
        self._admin_gids = frozenset(admin_gids)
        self._rules = list(namespace_rules)
        own = (0, os.getuid())
        self._copy_uids = frozenset(own if client_copy_uids is None else client_copy_uids)
        self._copy_gids = frozenset(client_copy_gids or ())

    @staticmethod
    def _matches(peer: Peer, uids: frozenset[int] | None, gids: frozenset[int] | None) -> bool:
        return peer.uid in (uids or ()) or bool(peer.gids & (gids or frozenset()))

    def may_connect(self, peer: Peer) -> bool:
        if self._allow_uids is None and self._allow_gids is None:
            return True
        if peer.uid in (0, os.getuid()):
            return True
        return self._matches(peer, self._allow_uids, self._allow_gids)

    def _rule(self, namespace: str) -> NamespaceRule | None:
        return next((r for r in self._rules if fnmatch.fnmatchcase(namespace, r.pattern)), None)

    def may_open(self, peer: Peer, namespace: str) -> bool:
        """May read it (and maybe write: ``may_write``)."""
        if not self._rules:
            return True
        rule = self._rule(namespace)
        if rule is None:
            return False
        return self._matches(
            peer, frozenset(rule.uids + rule.read_uids), frozenset(rule.gids + rule.read_gids)
        )

    def may_write(self, peer: Peer, namespace: str) -> bool:
        """May store into it."""
        if not self._rules:
            return True
        rule = self._rule(namespace)
        return rule is not None and self._matches(peer, frozenset(rule.uids), frozenset(rule.gids))

    def may_administer(self, peer: Peer) -> bool:
        return self._matches(peer, self._admin_uids, self._admin_gids)

    def may_map_region(self, peer: Peer) -> bool:
        return self._matches(peer, self._copy_uids, self._copy_gids)
