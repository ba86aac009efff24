"""What peers hold, per connection, per uid and in total: the ledger alone."""

from __future__ import annotations

import msgspec
import pytest

from kvoffload.protocol.errors import QuotaExceededError
from kvoffloadd.config import ConfigError, DaemonConfig
from kvoffloadd.ledger import LINES, SPECS, UNLIMITED, Ledger, Limits, Line, LineSpec, configured


def test_each_limit_binds_and_leaving_gives_everything_back() -> None:
    line = Line("pins", Limits(per_connection=10, per_uid=15, total=25))
    for conn, uid in ((1, 100), (2, 100), (3, 200), (4, 300)):
        line.join(conn, uid)
    assert line.take(1, 10) and not line.take(1, 1)  # the connection's own limit
    assert line.room(2) == 5 and not line.take(2, 6)  # uid 100 holds 10 of 15
    assert line.take(2, 5) and line.held_by_uid(100) == 15
    assert line.take(3, 10) and line.room(4) == 0  # everyone: 25
    assert line.refused_total == 2
    assert line.leave(1) == 10 and line.total == 15 and line.room(4) == 10
    line.give(2, 5)
    assert line.held_by_uid(100) == 0 and line.total == 10


def test_the_daemons_own_holders_are_neither_counted_nor_limited() -> None:
    line = Line("jobs", Limits.scaled(4))
    assert line.room(-1) == UNLIMITED and line.take(-1, 10**6)
    assert line.total == 0
    assert Limits.scaled(0).total == UNLIMITED
    assert Limits.scaled(4) == Limits(4, 16, 64)


def test_what_arrives_before_it_can_be_refused_names_the_limit_it_passed() -> None:
    line = Line("buffered_bytes", Limits(10, 15, 20))
    for conn, uid in ((1, 7), (2, 7), (3, 8)):
        line.join(conn, uid)
    line.add(1, 11)
    assert line.excess(1) == "connection"
    line.give(1, 2)
    line.add(2, 8)
    assert line.excess(2) == "uid" and line.excess(1) == "uid"
    line.give(2, 8)
    line.add(3, 10)
    line.add(2, 2)
    assert line.excess(3) == "total" and line.excess(2) == "total"
    assert line.over(3, 1) == "one connection's 10"


def test_a_take_is_all_or_nothing_across_lines_and_a_refusal_says_what_to_do() -> None:
    specs = [
        LineSpec("workers", "workers", Limits(2, 4, 8), 100, "attached workers", "detach"),
        LineSpec("caches", "caches", Limits(10, 20, 40), 10, "caches", "detach"),
    ]
    ledger = Ledger(specs)
    ledger.join(1, 500)
    ledger.require(1, {"workers": 1, "caches": 10}, "attach")
    with pytest.raises(QuotaExceededError) as err:
        ledger.require(1, {"workers": 1, "caches": 1}, "attach a worker of 1 cache")
    msg = str(err.value)
    assert "caches: 1 more would pass one connection's 10" in msg and "limits.caches" in msg
    assert ledger["workers"].held(1) == 1  # nothing of the refused take is held
    assert ledger.heap_bytes() == 100 + 10 * 10
    assert ledger.worst_heap_bytes() == 8 * 100 + 40 * 10
    assert ledger.leave(1) == {"workers": 1, "caches": 10}
    assert ledger.heap_bytes() == 0


def test_every_line_is_documented_and_bounds_the_heap() -> None:
    for spec in LINES:
        assert spec.meaning and spec.released and spec.unit
        lim = spec.limits
        assert lim.per_connection <= lim.per_uid <= lim.total, spec.name
    # The heap all peers together can make the daemon hold is finite by default (the
    # lines the service derives from the machine are filled in there).
    assert Ledger().worst_heap_bytes() < 4 << 30


def test_the_configuration_overrides_limits_by_line_and_refuses_unknown_lines() -> None:
    cfg = msgspec.convert(
        {
            "limits": {"pins": {"per_connection": 5, "total": "1KiB"}},
            "max_inflight_jobs_per_client": 3,
        },
        DaemonConfig,
    ).validate()
    specs = {s.name: s for s in configured(cfg.limit_overrides(), {})}
    assert specs["pins"].limits == Limits(5, SPECS["pins"].limits.per_uid, 1024)
    assert specs["jobs"].limits == Limits(3, 12, 48)  # the older key, scaled as it always was
    with pytest.raises(ConfigError, match="no such ledger line"):
        msgspec.convert({"limits": {"pints": {}}}, DaemonConfig).validate()
