"""What peers hold, per connection, per uid and in total: the ledger alone."""

from __future__ import annotations

from kvoffloadd.ledger import UNLIMITED, Ledger, Limits


def test_each_limit_binds_and_leaving_gives_everything_back() -> None:
    ledger = Ledger("pins", Limits(per_connection=10, per_uid=15, total=25))
    for conn, uid in ((1, 100), (2, 100), (3, 200), (4, 300)):
        ledger.join(conn, uid)
    assert ledger.take(1, 10) and not ledger.take(1, 1)  # the connection's own limit
    assert ledger.room(2) == 5 and not ledger.take(2, 6)  # uid 100 holds 10 of 15
    assert ledger.take(2, 5) and ledger.held_by_uid(100) == 15
    assert ledger.take(3, 10) and ledger.room(4) == 0  # everyone: 25
    assert ledger.refused_total == 2
    assert ledger.leave(1) == 10 and ledger.total == 15 and ledger.room(4) == 10
    ledger.give(2, 5)
    assert ledger.held_by_uid(100) == 0 and ledger.total == 10


def test_the_daemons_own_holders_are_neither_counted_nor_limited() -> None:
    ledger = Ledger("jobs", Limits.scaled(4))
    assert ledger.room(-1) == UNLIMITED and ledger.take(-1, 10**6)
    assert ledger.total == 0
    assert Limits.scaled(0).total == UNLIMITED
    assert Limits.scaled(4) == Limits(4, 16, 64)
