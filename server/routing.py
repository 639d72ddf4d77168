"""KVAwareRouter: Serve's request router for the engine deployment -- the replica with the most free KV memory,
then the one with the fewest requests.

Each engine replica reports its load every ``STATS_PERIOD_S`` (``EngineServer.record_routing_stats``): the
fraction of its KV pages free, and its running and waiting requests. Replicas whose free fraction is within
``band`` of the best count as equally roomy (a few pages apart is noise, not a reason to pile onto one);
among those the fewest requests wins, counting the calls this router sent since the replica's last report.
A replica that has not reported yet counts as empty. Requests no longer stay on a replica as Serve calls (their
tokens flow from the scheduler actor to the ingress), so Serve's default -- the shorter of two replicas' queues
of ongoing calls -- would see every replica idle.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

#: Seconds between an engine replica's load reports.
STATS_PERIOD_S = 0.5


def rank(stats: dict[Hashable, dict], sent: dict[Hashable, int], band: float) -> list[Hashable]:
    """Replicas best first: roomy ones (free KV fraction within ``band`` of the best) before the rest, then by
    requests (reported running + waiting, plus ``sent`` since the report), then at random."""
    best = max((s.get("kv_free", 1.0) for s in stats.values()), default=1.0)

    def key(replica: Hashable) -> tuple:
        s = stats[replica]
        return (s.get("kv_free", 1.0) < best - band, s.get("running", 0) + s.get("waiting", 0) + sent.get(replica, 0),
                random.random())

    return sorted(stats, key=key)


class KVAwareRouter(RequestRouter):
    def initialize_state(self, band: float = 0.1, **kwargs: Any) -> None:
        """``band``: free-KV fractions this close to the best one's count as equal."""
        if not 0 <= band <= 1:
            raise ValueError(f"band must be in [0, 1], got {band!r}")
        self.band = band
        self._sent: dict[ReplicaID, tuple[Any, int]] = {}  # replica -> (the report last seen, calls sent since)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Every candidate, best first, one to a rank (Serve tries them in order)."""
        replicas = {r.replica_id: r for r in candidate_replicas}
        stats = {i: r.routing_stats or {} for i, r in replicas.items()}
        sent = {}
        for i, s in stats.items():
            report, sent[i] = self._sent.get(i, (None, 0))
            if report != s.get("report"):
                self._sent[i], sent[i] = (s.get("report"), 0), 0  # a new report counts the calls sent before it
        return [[replicas[i]] for i in rank(stats, sent, self.band)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        report, sent = self._sent.get(replica_id, (None, 0))
        self._sent[replica_id] = (report, sent + 1)
