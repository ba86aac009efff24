"""What the Mooncake tier's poller asks of a master over plain sockets: the objects its
admin server lists, and whether its ports answer at all.

Rules:
- The listing (``/get_all_keys``) is data from another process: it is read a line at
  a time, each read at most ``MAX_LISTING_LINE`` + 1 bytes. A line longer than
  ``MAX_LISTING_LINE`` (our names are ``<prefix>/<32 hex>/<at most 128 hex>``) is
  skipped, a name under another prefix or of a tier id not opened here is skipped.
  One full read takes at most ``MAX_LISTING_LINES`` lines and ``MAX_LISTING_BYTES``
  bytes and keeps at most one object past ``max_entries`` of ours. Its time is
  bounded whatever the server sends (an endless line, a trickle, endless interim
  responses or trailers, which Python's HTTP client reads in loops of its own): the
  connection is shut down once ``MAX_LISTING_S`` plus the tier's ``timeout_s`` have
  passed since it opened, which ends any read in progress. A listing not read to its
  end says so: the caller removes nothing on it.
- ``reachable`` knocks on a master's or metadata server's port with a timeout from
  Python before Mooncake's ``setup``, which holds the GIL while it waits.
- Poller thread only; nothing here touches the tier's view.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable

from kvoffloadd.tiers.remote import Entry

MAX_LISTING_LINES = 4 << 20  # lines of /get_all_keys one full read takes at most
MAX_LISTING_LINE = 256  # bytes: our names are <prefix>/<32 hex>/<at most 128 hex>
MAX_LISTING_BYTES = 1 << 30  # bytes one full read takes at most
MAX_LISTING_S = 120.0  # no read of a listing starts after this


def read_listing(
    admin_url: str,
    prefix: str,
    ours: Callable[[str], str | None],
    max_entries: int,
    timeout_s: float,
    max_bytes: int = MAX_LISTING_BYTES,
    max_s: float = MAX_LISTING_S,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[set[Entry], bool]:
    """The objects under ``prefix`` of tier ids that ``ours`` knows, as the admin
    server at ``admin_url`` lists them; and whether the listing was read to its end.
    Raises ``OSError`` or ``http.client.HTTPException`` when the server cannot be
    asked or answers other than 200 within its time."""
    url = urllib.parse.urlsplit(admin_url.rstrip("/") + "/get_all_keys")
    https = url.scheme == "https"
    make = http.client.HTTPSConnection if https else http.client.HTTPConnection
    conn = make(url.hostname or "", url.port, timeout=timeout_s)
    conn.connect()  # within timeout_s
    cut = threading.Event()

    def cut_off() -> None:  # ends whatever read the poller is in
        cut.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # closed already
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(max_s + timeout_s, cut_off)
    timer.daemon = True
    timer.start()
    try:
        return _read_lines(conn, url.path, prefix, ours, max_entries, max_bytes, max_s, clock, cut)
    except (OSError, http.client.HTTPException):
        if cut.is_set():
            return set(), False
        raise
    finally:
        timer.cancel()
        conn.close()


def _read_lines(
    conn: http.client.HTTPConnection,
    path: str,
    prefix: str,
    ours: Callable[[str], str | None],
    max_entries: int,
    max_bytes: int,
    max_s: float,
    clock: Callable[[], float],
    cut: threading.Event,
) -> tuple[set[Entry], bool]:
    lead = (prefix + "/").encode()
    out: set[Entry] = set()
    left_bytes, end_s = max_bytes, clock() + max_s
    conn.request("GET", path)
    r = conn.getresponse()
    if r.status != 200:
        raise http.client.HTTPException(f"the listing answered {r.status} {r.reason}")
    for _ in range(MAX_LISTING_LINES):
        if left_bytes <= 0 or clock() > end_s:
            break
        line = r.readline(MAX_LISTING_LINE + 1)
        left_bytes -= len(line)
        if not line:  # the end, unless the time ran out or the body stopped short
            return out, not cut.is_set() and not r.length
        if len(line) > MAX_LISTING_LINE:  # skip the rest of an overlong line
            while line and not line.endswith(b"\n") and left_bytes > 0 and clock() <= end_s:
                line = r.readline(MAX_LISTING_LINE + 1)
                left_bytes -= len(line)
            continue
        entry = listed_entry(line.strip(), lead, ours)
        if entry is not None:
            out.add(entry)
            if len(out) > max_entries:
                break
    return out, False


def listed_entry(line: bytes, lead: bytes, ours: Callable[[str], str | None]) -> Entry | None:
    """The (tier id, key) a listed name stands for, or None when it is not ours."""
    if not line.startswith(lead):
        return None
    tid_raw, _, hexkey = line[len(lead) :].partition(b"/")
    tid = ours(tid_raw.decode("ascii", "replace"))
    if tid is None or not 0 < len(hexkey) <= 128:
        return None
    try:
        return (tid, bytes.fromhex(hexkey.decode("ascii")))
    except (ValueError, UnicodeDecodeError):
        return None


def reachable(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``address`` (host:port, or an http:// or etcd://
    URL) opens within ``timeout_s``; other schemes are not checked (True)."""
    if "://" in address:
        parsed = urllib.parse.urlparse(address)
        if parsed.scheme not in ("http", "https", "etcd") or parsed.hostname is None:
            return True
        host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    else:
        name, _, port_text = address.rpartition(":")
        if not name or not port_text.isdigit():  # P2PHANDSHAKE: no server to knock on
            return True
        host, port = name.strip("[]"), int(port_text)
    try:
        with socket.create_connection((host, port), timeout=max(timeout_s, 0.1)):
            return True
    except OSError:
        return False
