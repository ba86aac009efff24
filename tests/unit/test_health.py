"""/healthz and /readyz decide from the stats the loop publishes: the reasons a probe
sees, without a daemon (the live endpoint is tested in test_operations)."""

from __future__ import annotations

import json
import time
from typing import Any

from kvoffloadd.metrics import HEALTH_STALE_S, MetricsEndpoint, readiness


def stats(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "server": {"shutting_down": False},
        "region": {"prefaulted_bytes": 100, "data_bytes": 100},
        "gpu": {"enabled": False},
    }
    for section, fields in over.items():
        base[section] = {**base[section], **fields}
    return base


def test_readiness_names_what_is_pending() -> None:
    assert readiness(stats()) == []
    assert readiness(stats(region={"prefaulted_bytes": 25})) == ["pre-faulting the region (25%)"]
    pinning = {"enabled": True, "pinned_bytes": 10, "pin_target_bytes": 100, "pin_error": ""}
    assert readiness(stats(gpu=pinning)) == ["pinning the region (10 of 100)"]
    failed = dict(pinning, pin_error="cuMemHostRegister: out of memory")
    assert readiness(stats(gpu=failed)) == []  # failed pinning is reported, not waited for
    assert readiness(stats(server={"shutting_down": True})) == ["shutting down"]


def test_probes_answer_503_with_the_reason_until_the_loop_publishes() -> None:
    ep = MetricsEndpoint("127.0.0.1", 0)
    try:
        status, _, body = ep._healthz()
        assert status == 503 and not json.loads(body)["alive"]
        status, _, body = ep._readyz()
        assert status == 503 and json.loads(body)["pending"] == ["starting"]
        full = stats(region={"prefaulted_bytes": 50})
        full |= {"copies": {"stored_bytes_total": 0, "loaded_bytes_total": 0}}
        ep._last, ep._published_s = full, time.monotonic()  # just published
        status, _, body = ep._healthz()
        assert status == 200 and json.loads(body)["alive"]
        status, _, body = ep._readyz()
        assert status == 503 and json.loads(body)["pending"] == ["pre-faulting the region (50%)"]
        ep._published_s = -HEALTH_STALE_S  # the loop stopped turning
        status, _, body = ep._healthz()
        assert status == 503 and "has not turned" in json.loads(body)["reason"]
    finally:
        ep.close()
