"""What the loop tells the world outside its sockets, once per cron period.

Rules:
- The period is ``CRON_PERIOD_S``, or half systemd's watchdog interval when that is
  shorter, so a ``WATCHDOG=1`` is never late while the loop turns.
- Each beat publishes a stats snapshot to the metrics endpoint (when one listens; its
  readiness probe reads the snapshot's age against the period) and tells systemd
  (when it supervises the daemon) the progress line (``STATUS=``, sent only when it
  changes) and liveness (``WATCHDOG=1``). Pinning the region takes minutes on a large
  one: while it runs each beat extends systemd's start-up timeout past the next beat.
- A beat reads the service's counters only; it changes nothing. It runs on the loop
  thread (the stats are the loop's to read) and costs one snapshot per period, not
  per request.
"""

from __future__ import annotations

from kvoffloadd.server.metrics import MetricsEndpoint
from kvoffloadd.server.systemd import Notifier, watchdog_interval_s
from kvoffloadd.service.service import Service
from kvoffloadd.service.stats import render_stats

CRON_PERIOD_S = 1.0


class Heartbeat:
    def __init__(
        self, service: Service, notifier: Notifier, metrics: MetricsEndpoint | None
    ) -> None:
        self.service = service
        self.notifier = notifier
        self.metrics = metrics
        self._watchdog_s = watchdog_interval_s() if notifier.enabled else None
        self.period_s = min(CRON_PERIOD_S, self._watchdog_s or CRON_PERIOD_S)
        self._status = ""
        if metrics is not None:  # every series and the probes from the first scrape on
            metrics.publish(render_stats(service), self.period_s)

    def beat(self, clients: int) -> None:
        """Publish the stats; tell systemd the progress and that the loop turns
        (``clients``: the connections served now)."""
        if self.metrics is not None:
            self.metrics.publish(render_stats(self.service), self.period_s)
        if not self.notifier.enabled:
            return
        fields: dict[str, str | int] = {}
        status, extend = self.status(clients)
        if extend:  # keep systemd's timeouts ahead of a pinning that takes minutes
            fields["EXTEND_TIMEOUT_USEC"] = int(4 * self.period_s * 1e6)
        if status != self._status:
            fields["STATUS"] = self._status = status
        if self._watchdog_s is not None:
            fields["WATCHDOG"] = 1
        if fields:
            self.notifier.notify(**fields)

    def status(self, clients: int) -> tuple[str, bool]:
        """The progress line, and whether the region is being pinned (start-up goes
        on)."""
        region = self.service.region
        data_bytes = region.geometry.num_extents * region.geometry.extent_bytes
        done = region.prefaulted_bytes
        pinner = self.service.gpu.pinner if self.service.gpu is not None else None
        if pinner is not None and pinner.running and pinner.total_bytes:
            pinned = 100 * pinner.pinned_bytes // pinner.total_bytes
            return f"serving; pinning region {pinned}%", True
        if done < data_bytes and region.prefaulting:
            return f"serving; pre-faulting region {100 * done // data_bytes}%", False
        return f"serving {clients} clients", False
