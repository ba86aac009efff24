"""Redis tier: blocks in a Redis server that several daemons (nodes) can share.

Rules:
- Data: one hash per block at ``<prefix>:b:<tier id>:<key>``: field ``m`` is its seal
  (blockauth.py: magic, key id, length, keyed MAC), field ``d`` the block. Tier ids
  come from the namespace name and layout fingerprint, so only daemons serving the same
  namespace share its blocks, and only those with the same tier secret can read them.
  A block with any other seal (another secret, an older format, a forgery) fails.
- Every byte from the server goes through one bounded RESP reader (resp.py), each
  tier thread on a connection of its own: no reply, whatever the server sends, holds
  more than the reader's bounds or longer than ``timeout_s``.
- Bytes are never copied by Python: a store sends the slot itself (``sendmsg`` of the
  commands around it), and a load reads ``HMGET m d`` and receives the block into the
  slot, with at most ``LOAD_WINDOW_BYTES`` of blocks asked for and not yet received.
  Each block's MAC is computed over the slot by a promotion thread (``tier_threads``)
  as soon as the block is in, while the connection receives the next.
- Index: the sorted set ``<prefix>:idx`` holds every block as ``<tier id>:<bytes>:<key>``
  scored by its last use (Redis server time, ms), and ``<prefix>:bytes`` their total.
  Writing, touching and evicting are Lua scripts, so each is atomic on the server
  whichever daemon runs it. A write over ``capacity_bytes`` evicts the least recently
  used blocks of every daemon, at most ``MAX_EVICTIONS_PER_WRITE`` per write (0: no
  budget; Redis's own ``maxmemory`` applies). One key space per server: the scripts name
  keys they are not passed, so a cluster is not supported.
- View: which blocks exist comes from the index, read by a thread on its own raw
  connection, every ``refresh_s`` (new and touched blocks) and in full every
  ``full_sync_s`` (blocks other daemons evicted, or TTL expired, leave). Anyone who can
  write to the server can write the index, so what it says is bounded before use:
  members longer than ``MAX_MEMBER_BYTES`` are dropped unread, scores must lie between
  0 and the server's clock (plus ``SCORE_SLACK_MS``), a refresh reads at most
  ``INDEX_PAGE`` members from where the last one stopped (a cursor of score and offset
  that only the server's clock moves forward), a full read at most ``MAX_SCAN_CALLS``
  pages per namespace and ``max_view_blocks`` members, and the view itself is capped
  (remote.py). Lookups answer from the view without I/O. A block the view has but
  Redis lost fails its load once and leaves the view.
- Failure: a connection error or timeout marks the tier unhealthy; lookups then miss
  and writes fail (counted) until the poller reaches the server again. The region and
  the daemon are unaffected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvoffloadd.tiers.base import TierError, TierJob
from kvoffloadd.tiers.blockauth import BlockMac, SealCheck
from kvoffloadd.tiers.remote import MAX_VIEW_BLOCKS, Entry, RemoteTier
from kvoffloadd.tiers.resp import RespConnection, RespError, check_url, encode, encode_head
from kvoffloadd.tiers.spread import JobThreads

log = logging.getLogger(__name__)

MAGIC = b"KVORED04"  # a blockauth seal in field m (KVORED03: a CRC-32, refused)
# Block bytes a load connection has asked for and not yet received. Redis builds every
# reply in fresh memory before it writes it out: a deep pipeline (8 blocks on each of
# 4 connections) had it fault in 64 MiB per round and promote 1.5x slower.
LOAD_WINDOW_BYTES = 4 << 20
# Index members are <tier id (32)>:<bytes>:<key (at most 64)>: anything longer is not
# one of ours, and is dropped by the reader without being held.
MAX_MEMBER_BYTES = 128
INDEX_PAGE = 4096  # members a refresh reads at most
SCAN_COUNT = 1000  # ZSCAN's COUNT hint
MAX_SCAN_CALLS = 2048  # ZSCAN pages per namespace in one full read (about 2M members)
SCORE_SLACK_MS = 60_000  # scores later than the server's clock by more are not believed
MAX_EVICTIONS_PER_WRITE = 256  # members one write's script evicts at most

# The bytes travel in plain HSET/HGETALL commands (through Lua they would be copied
# twice more); these scripts keep the index and the byte total in step atomically.

# KEYS: data, index, bytes. ARGV: member, nbytes, capacity, prefix, most evictions. After a block's
# HSET: index it, count it, evict least recently used blocks beyond the capacity.
_INDEX_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZADD', KEYS[2], now, ARGV[1]) == 1 then
  redis.call('INCRBY', KEYS[3], ARGV[2])
end
local out = {}
local cap = tonumber(ARGV[3])
if cap > 0 then
  for _ = 1, tonumber(ARGV[5]) do
    if (tonumber(redis.call('GET', KEYS[3]) or '0') or 0) <= cap then break end
    local pop = redis.call('ZPOPMIN', KEYS[2])
    if #pop == 0 then break end
    local m = pop[1]
    if m == ARGV[1] then
      redis.call('ZADD', KEYS[2], pop[2], m)
      break
    end
    local tid, n, k = string.match(m, '^([^:]*):(%d+):(.*)$')
    redis.call('DEL', ARGV[4] .. ':b:' .. tid .. ':' .. k)
    redis.call('DECRBY', KEYS[3], n)
    table.insert(out, m)
  end
end
return out
"""

# KEYS: data, index, bytes. ARGV: member, nbytes. After a block's HGETALL: mark it
# used, or forget its index entry if its data is gone (TTL, maxmemory).
_TOUCH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[2], 'XX', now, ARGV[1])
elseif redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('DECRBY', KEYS[3], ARGV[2])
end
return 0
"""


_ERRORS = (OSError, RespError)  # the server unreachable, or not speaking RESP


def _count(raw: Any) -> int:
    """A byte count another writer may have garbled: what is not a plain number of at
    most 19 digits is 0."""
    if not isinstance(raw, bytes) or not raw.isdigit() or len(raw) > 19:
        return 0
    return int(raw)


def _score(raw: Any) -> float | None:
    """A score as Redis sends it; None if it is not a finite number."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


def member(e: Entry, nbytes: int) -> bytes:
    return f"{e[0]}:{nbytes}:".encode() + e[1]


def parse_member(m: Any) -> tuple[Entry, int] | None:
    """(tier id, key) and byte count of an index member; None for anything malformed
    (not bytes, too long, a count that is not a short number)."""
    if not isinstance(m, bytes) or len(m) > MAX_MEMBER_BYTES:
        return None
    parts = m.split(b":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or len(parts[1]) > 19 or not parts[2]:
        return None
    return (parts[0].decode("ascii", "replace"), parts[2]), int(parts[1])


def _pairs(items: Any) -> list[tuple[Any, float]]:
    """(member, score) pairs of a WITHSCORES reply, rows with a bad score left out."""
    if not isinstance(items, list):
        raise RespError(f"expected an array of members, got {type(items).__name__}")
    out = []
    for i in range(0, len(items) - 1, 2):
        score = _score(items[i + 1])
        if score is not None:
            out.append((items[i], score))
    return out


class RedisTier(RemoteTier):
    kind = "redis"

    def __init__(
        self,
        name: str,
        url: str,
        capacity_bytes: int,
        wake: Any,
        *,
        mac: BlockMac,
        prefix: str = "kvoffload",
        ttl_s: float = 0.0,
        connections: int = 4,
        timeout_s: float = 2.0,
        refresh_s: float = 0.2,
        full_sync_s: float = 10.0,
        max_view_blocks: int = MAX_VIEW_BLOCKS,
        tier_threads: int = 1,
    ) -> None:
        try:
            check_url(url)
        except ValueError as exc:
            raise TierError(f"tier {name}: bad url {url!r}: {exc}") from exc
        # the threads start once nothing can refuse the start
        super().__init__(name, url, capacity_bytes, wake, max_view_blocks, tier_threads)
        self.promotion_jobs = connections  # a job's blocks come on one connection
        self.seals = SealCheck(mac, name, MAGIC)
        self.url = url
        self._prefix = prefix
        self._idx = f"{prefix}:idx".encode()
        self._bytes_key = f"{prefix}:bytes".encode()
        self._ttl_ms = int(ttl_s * 1000)
        self._timeout_s = timeout_s
        self._local = threading.local()  # each tier thread's RespConnection
        self._conns: list[RespConnection] = []  # all of them, closed with the tier
        self._index_conn = RespConnection(url, timeout_s)  # the poller's
        self._conns.append(self._index_conn)
        self._scan_cut_logged = False
        self._refresh_s = refresh_s
        self._full_sync_s = full_sync_s
        self._want_full = threading.Event()
        self._stop = threading.Event()
        self._pool = JobThreads(connections, name)
        self._poller = threading.Thread(target=self._poll, name=f"kvoffload-{name}-poll")
        self._poller.daemon = True
        self._poller.start()

    # ------------------------------------------------------------ loop thread

    def namespace_added(self) -> None:
        self._want_full.set()

    def submit_store(self, job: TierJob) -> None:
        self._pool.submit(self._store, job, self.track(job, True))

    def submit_load(self, job: TierJob) -> None:
        self._pool.submit(self._load, job, self.track(job, False))

    def statistics(self) -> dict[str, Any]:
        return self.remote_statistics(url=self.url)

    def close(self) -> None:
        self._stop.set()
        self._want_full.set()
        if not self.stop_threads(self._pool, [self._poller]):
            return  # a stuck thread's socket stays open with it
        for conn in self._conns:
            conn.close()

    # ------------------------------------------------------------ worker threads

    def _data_key(self, e: Entry) -> bytes:
        return f"{self._prefix}:b:{e[0]}:".encode() + e[1]

    def _store_parts(self, job: TierJob, entries: list[Entry]) -> list[bytes | memoryview]:
        """A store job's pipeline: per block DEL (a block written again replaces, never
        mixes, fields), HSET of its seal and the slot itself, [PEXPIRE,] the index
        script (sent whole: a server whose script cache was flushed still runs it, and
        no block is left written but unindexed)."""
        nbytes = job.ns.block_bytes
        parts: list[bytes | memoryview] = []
        between = b""  # the commands after one block and before the next
        for e, buf in zip(entries, job.buffers):
            data = self._data_key(e)
            seal = self.seals.seal(job.ns, e[1], buf)
            head = encode_head(b"HSET", data, b"m", seal, b"d", last_bytes=buf.nbytes)
            parts += [between + encode(b"DEL", data) + head, buf]
            between = b"\r\n"
            if self._ttl_ms:
                between += encode(b"PEXPIRE", data, self._ttl_ms)
            between += encode(
                b"EVAL",  # the script itself (under 1 KiB): no cache on the server to lose
                _INDEX_LUA,
                3,
                data,
                self._idx,
                self._bytes_key,
                member(e, nbytes),
                nbytes,
                self.capacity_bytes,
                self._prefix,
                MAX_EVICTIONS_PER_WRITE,
            )
        parts.append(between)
        return parts

    def _store(self, job: TierJob, entries: list[Entry]) -> None:
        ok = [False] * len(entries)
        gone: list[Entry] = []
        done = 0
        conn = self._conn()
        try:
            conn.send_parts(self._store_parts(job, entries))
            per_key = 4 if self._ttl_ms else 3  # delete, hset, [pexpire,] index script
            replies = conn.read_replies(per_key * len(entries), MAX_MEMBER_BYTES)
            # One bad key (a wrong type planted at its name) fails that key only.
            for i, buf in enumerate(job.buffers):
                mine = replies[i * per_key : (i + 1) * per_key]
                ok[i] = not any(isinstance(r, RespError) for r in mine)
                done += buf.nbytes if ok[i] else 0
                if ok[i] and isinstance(mine[-1], list):
                    evicted = mine[-1][:MAX_EVICTIONS_PER_WRITE]
                    gone.extend(p[0] for m in evicted if (p := parse_member(m)))
        except _ERRORS as exc:
            conn.close()
            self._failed(exc)
        except Exception as exc:  # a tier fault stays inside the tier
            conn.close()
            log.warning("tier %s: a store failed: %r", self.name, exc)
        self.finished.post("job", (job.result(ok, done), gone))

    def _load(self, job: TierJob, entries: list[Entry]) -> None:
        """Receive a job's blocks into their slots; each is verified on a promotion
        thread as soon as it is in, while the next ones arrive."""
        nbytes = job.ns.block_bytes
        seals: list[Any] = [None] * len(entries)  # per key: its seal, once the block is in

        def verify(i: int) -> bool:
            return self._check(seals[i], job, entries[i][1], job.buffers[i])

        def done(results: list[bool | None]) -> None:
            ok = [r is True for r in results]
            refused = [e for e, m, good in zip(entries, seals, ok) if m is not None and not good]
            self.post_refused(refused)
            moved = sum(len(b) for b, good in zip(job.buffers, ok) if good)
            self.finished.post("job", (job.result(ok, moved), []))

        spread = self.tier_threads.spread(len(entries), nbytes, verify, done, ready=0)
        conn = self._conn()
        try:
            cmds = []  # per key: its read and its touch
            for e in entries:
                data = self._data_key(e)
                args = (data, self._idx, self._bytes_key, member(e, nbytes), nbytes)
                touch = encode("EVAL", _TOUCH_LUA, 3, *args)
                cmds.append(encode("HMGET", data, "m", "d") + touch)
            window = max(1, LOAD_WINDOW_BYTES // nbytes)
            conn.send(cmds[:window])
            for i, out in enumerate(job.buffers):
                if i + window < len(cmds):
                    conn.send([cmds[i + window]])  # one more in flight as one arrives
                fields = conn.read_array_header()
                if isinstance(fields, RespError):  # a foreign value at the key: this one fails
                    conn.read()
                    continue
                if fields != 2:
                    raise RespError(f"HMGET answered {fields} fields, not 2")
                meta = conn.read(MAX_MEMBER_BYTES)  # a seal; anything longer is dropped
                whole = conn.read_into(out)
                conn.read()  # the touch: an error there costs recency only
                if whole is True and isinstance(meta, bytes):
                    seals[i] = meta
                    spread.release(i + 1)
        except _ERRORS as exc:
            conn.close()
            self._failed(exc)
        except Exception as exc:  # a tier fault stays inside the tier
            conn.close()
            log.warning("tier %s: a load failed: %r", self.name, exc)
        spread.release(len(entries))  # blocks not received fail without a check

    def _conn(self) -> RespConnection:
        """This thread's connection, for one job's exchange."""
        conn: RespConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = RespConnection(self.url, self._timeout_s)
            self._conns.append(conn)  # list.append is atomic: threads add their own
        conn.begin()
        return conn

    def _check(self, meta: Any, job: TierJob, key: bytes, out: memoryview) -> bool:
        """A block read whole into ``out`` carries its seal."""
        if not isinstance(meta, bytes):
            return False  # evicted or expired since the view saw it, or not received
        ok: bool = self.seals.check(meta, job.ns, key, out, f"key {key.hex()} of {job.ns.name}")
        return ok

    def _failed(self, exc: BaseException) -> None:
        self.post_unreachable(f"{type(exc).__name__}: {exc}")

    def _poll(self) -> None:
        """Follow the shared index: new blocks often, everything now and then."""
        cursor = (0.0, 0)  # where the next refresh starts: (score, members at it seen)
        next_full = 0.0
        up = True
        while not self._stop.is_set():
            try:
                now_ms = self._server_ms()
                if self._want_full.is_set() or time.monotonic() >= next_full:
                    self._want_full.clear()
                    started = time.monotonic()
                    self._full_sync(started, now_ms)
                    cursor = (max(0.0, now_ms - 1000.0), 0)
                    next_full = started + self._full_sync_s
                else:
                    cursor = self._incremental(cursor, now_ms)
                used = _count(self._call(b"GETRANGE", self._bytes_key, 0, 31, strict=False))
                if not up:
                    up = True
                    self._want_full.set()
                self.finished.post("health", (True, "", used))
            except Exception as exc:  # never the end of the poller: retried, reported
                up = False
                self._index_conn.close()
                self._failed(exc)
            self._want_full.wait(self._refresh_s if up else max(self._refresh_s, 1.0))

    def _call(self, *args: bytes | str | int, strict: bool = True) -> Any:
        """One command on the poller's connection; bulk strings in the reply longer than
        ``MAX_MEMBER_BYTES`` come back as ``RespError`` items, unread. An error reply
        raises (``strict``) or is returned."""
        conn = self._index_conn
        conn.begin()
        conn.send([encode(*args)])
        reply = conn.read(MAX_MEMBER_BYTES)
        if strict and isinstance(reply, RespError):
            raise reply
        return reply

    def _server_ms(self) -> float:
        """The server's clock (what scores are written with), in ms."""
        reply = self._call(b"TIME")
        if not isinstance(reply, list) or len(reply) != 2:
            raise RespError(f"TIME answered {reply!r:.60}")
        return int(reply[0]) * 1000.0 + int(reply[1]) // 1000

    def _mine(self, rows: Sequence[tuple[Any, float]], hi_ms: float) -> list[Entry]:
        out = []
        for m, score in rows:
            parsed = parse_member(m)
            if parsed is None or not 0 <= score <= hi_ms:
                continue
            tid = self.ours(parsed[0][0])
            if tid is not None:
                out.append((tid, parsed[0][1]))
        return out

    def _full_sync(self, started: float, now_ms: float) -> None:
        """Every member of the namespaces opened here, as far as the bounds allow."""
        hi = now_ms + SCORE_SLACK_MS
        present: set[Entry] = set()
        complete = True
        for tid in sorted(self._tier_ids):
            cursor: Any = b"0"
            for _ in range(MAX_SCAN_CALLS):
                reply = self._call(
                    b"ZSCAN", self._idx, cursor, b"MATCH", f"{tid}:*", b"COUNT", SCAN_COUNT
                )
                if not isinstance(reply, list) or len(reply) != 2:
                    raise RespError(f"ZSCAN answered {reply!r:.60}")
                cursor, items = reply
                present.update(self._mine(_pairs(items), hi))
                if cursor == b"0" or len(present) > self.max_view_blocks:
                    break
            if cursor != b"0":
                complete = False
                if not self._scan_cut_logged:
                    self._scan_cut_logged = True
                    log.warning(
                        "tier %s: the index %s holds more members than one full read "
                        "takes (%d pages, or %d of ours); the view follows it partly",
                        self.name,
                        self._idx.decode(errors="replace"),
                        MAX_SCAN_CALLS,
                        self.max_view_blocks,
                    )
                break
        self.post_full(started, present, complete)

    def _incremental(self, cursor: tuple[float, int], now_ms: float) -> tuple[float, int]:
        """At most ``INDEX_PAGE`` members from the cursor up to the server's clock; the
        cursor after them."""
        lo, skip = cursor
        hi = now_ms + SCORE_SLACK_MS
        reply = self._call(
            b"ZRANGEBYSCORE",
            self._idx,
            repr(lo),
            repr(hi),
            b"WITHSCORES",
            b"LIMIT",
            skip,
            INDEX_PAGE,
        )
        rows = _pairs(reply)
        if not rows:
            return cursor
        self.post_seen(self._mine(rows, hi))
        last = rows[-1][1]
        at_last = sum(1 for _, score in rows if score == last)
        return (last, skip + at_last) if last == lo else (last, at_last)
