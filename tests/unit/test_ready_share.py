"""A turn's reads shared out among uids (server.ready), on made-up descriptors: no
sockets, no epoll."""

from __future__ import annotations

import pytest

from kvoffloadd.server import ready as readyshare
from kvoffloadd.server.ready import ReadyShare

IN = 1  # an event mask; its value does not matter here


def test_watched_descriptors_are_never_held_back_and_each_uid_gets_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(readyshare, "READY_PER_TURN", 4)
    uids = dict.fromkeys(range(100, 110), 1000) | {200: 2000, 201: 2000}
    more = [(fd, IN) for fd in range(104, 110)] + [(200, IN), (201, IN), (5, IN)]
    share = ReadyShare(lambda n: more[:n])
    first = share.share([(100, IN), (101, IN), (102, IN), (103, IN)], uids.get)
    fds = [fd for fd, _ in first]
    assert 5 in fds  # a watched descriptor (a wake-up, the listener) comes at once
    assert sorted(fd for fd in fds if fd != 5) == [100, 101, 200, 201]  # 2 and 2
    second = share.share([], uids.get)
    assert [fd for fd, _ in second] == [102, 103, 104, 105]
    third = share.share([], uids.get)
    assert [fd for fd, _ in third] == [106, 107, 108, 109]
    assert share.share([], uids.get) == [] and not share.pending


def test_events_merge_while_waiting_and_a_dropped_connection_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(readyshare, "READY_PER_TURN", 2)
    uids = dict.fromkeys((10, 11, 12, 13), 1000)
    share = ReadyShare(lambda n: [(12, 1), (13, 1)])
    assert [fd for fd, _ in share.share([(10, 1), (11, 1)], uids.get)] == [10, 11]
    share.forget(12)  # dropped while it waited
    assert share.share([(13, 4)], uids.get) == [(13, 5)]  # its events merged
    assert not share.pending
