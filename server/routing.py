"""KVAwareRouter: Serve's request router for the engine deployment -- the replica whose prefix cache most likely
holds the start of the request, unless that would overload it; else the replica with the most free KV memory, then
the one with the fewest requests.

Each engine replica reports its load every ``STATS_PERIOD_S`` (``EngineServer.record_routing_stats``): the
fraction of its KV pages free, and its running and waiting requests. Replicas whose free fraction is within
``band`` of the best count as equally roomy (a few pages apart is noise, not a reason to pile onto one);
among those the fewest requests wins, counting the calls this router sent since the replica's last report.
A replica that has not reported yet counts as empty. Requests no longer stay on a replica as Serve calls (their
tokens flow from the scheduler actor to the ingress), so Serve's default -- the shorter of two replicas' queues
of ongoing calls -- would see every replica idle.

Prefix affinity (Ray Serve LLM's prefix-aware router and vLLM production-stack's are the anchors): the router
remembers, per replica, chained keys of the leading 64-character chunks of the requests it sent there (a prompt's
token ids as text -- the ingress tokenizes, a chat through its template -- salted by the request's ``cache_salt``). A request whose text shares at least
``min_match`` of its chunks with what a replica got goes to that replica -- its engine most likely still caches
those pages -- unless the replica is short of KV memory (outside ``band``) or holds more than ``imbalance`` requests
more than the least loaded one, when the ranking above decides. Each ingress replica's router knows only what it
sent itself: with several, the affinity is per ingress.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cluster.scheduler_actor import AddCall

#: Seconds between an engine replica's load reports.
STATS_PERIOD_S = 0.5
#: Characters of a request's text per routing chunk (about 16 tokens of English; a few cache pages).
CHUNK_CHARS = 64


def request_text(pending: PendingRequest | None) -> tuple[str, str | None]:
    """(the text a request starts with, its cache salt): the first prompt (text, or token ids as text: the ingress
    sends ids, a chat's through its template); ("", None) for a call that is no ``EngineServer.add`` of an ``AddCall``."""
    call = pending.args[0] if pending is not None and len(pending.args) == 1 and not pending.kwargs else None
    if not isinstance(call, AddCall):
        return "", None
    first = (call.prompts or [""])[0]
    return (first if isinstance(first, str) else ",".join(map(str, first))), call.cache_salt


def prefix_keys(text: str, salt: str | None = None) -> list[int]:
    """Chained keys of ``text``'s whole ``CHUNK_CHARS``-character chunks (equal keys: equal text up to there)."""
    keys, parent = [], hash(salt)
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hash((parent, text[start : start + CHUNK_CHARS]))
        keys.append(parent)
    return keys


class PrefixTable:
    """Per replica, the prefix keys of the requests routed there, the least recently routed dropped beyond
    ``capacity`` keys a replica (its engine evicted those pages long ago, most likely)."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._keys: dict[Hashable, OrderedDict[int, None]] = {}

    def match(self, replica: Hashable, keys: list[int]) -> int:
        """How many of ``keys``, from the first, ``replica`` got."""
        held, n = self._keys.get(replica, {}), 0
        while n < len(keys) and keys[n] in held:
            n += 1
        return n

    def add(self, replica: Hashable, keys: list[int]) -> None:
        held = self._keys.setdefault(replica, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def retain(self, replicas: set[Hashable]) -> None:
        """Forget replicas that are gone."""
        for gone in set(self._keys) - replicas:
            del self._keys[gone]


def rank(stats: dict[Hashable, dict], sent: dict[Hashable, int], band: float) -> list[Hashable]:
    """Replicas best first: roomy ones (free KV fraction within ``band`` of the best) before the rest, then by
    requests (reported running + waiting, plus ``sent`` since the report), then at random."""
    best = max((s.get("kv_free", 1.0) for s in stats.values()), default=1.0)

    def key(replica: Hashable) -> tuple:
        s = stats[replica]
        return (s.get("kv_free", 1.0) < best - band, s.get("running", 0) + s.get("waiting", 0) + sent.get(replica, 0),
                random.random())

    return sorted(stats, key=key)


def prefer_prefix(ranked: list[Hashable], stats: dict[Hashable, dict], sent: dict[Hashable, int], band: float,
                  matches: dict[Hashable, int], total: int, min_match: float, imbalance: int) -> list[Hashable]:
    """``ranked`` with the replica that matched most of the request's ``total`` prefix keys first, if it matched at
    least ``min_match`` of them, is within ``band`` of the most free KV memory, and holds at most ``imbalance``
    requests more than the least loaded replica."""
    if not total or not ranked:
        return ranked
    best = max(ranked, key=lambda r: matches.get(r, 0))  # the first of the best, in ranked order
    if matches.get(best, 0) < min_match * total or best == ranked[0]:
        return ranked
    free = max(s.get("kv_free", 1.0) for s in stats.values())

    def load(r: Hashable) -> int:
        return stats[r].get("running", 0) + stats[r].get("waiting", 0) + sent.get(r, 0)

    if stats[best].get("kv_free", 1.0) < free - band or load(best) - min(map(load, ranked)) > imbalance:
        return ranked
    return [best] + [r for r in ranked if r != best]


class KVAwareRouter(RequestRouter):
    def initialize_state(self, band: float = 0.1, min_match: float = 0.1, imbalance: int = 16, **kwargs: Any) -> None:
        """``band``: free-KV fractions this close to the best one's count as equal. Prefix affinity: a replica that
        got at least ``min_match`` of a request's prefix keys is preferred while it holds at most ``imbalance``
        requests more than the least loaded one (Ray Serve LLM's defaults: 0.1, and an imbalance of 10)."""
        if not 0 <= band <= 1:
            raise ValueError(f"band must be in [0, 1], got {band!r}")
        if not 0 < min_match <= 1:
            raise ValueError(f"min_match must be in (0, 1], got {min_match!r}")
        if not isinstance(imbalance, int) or imbalance < 0:
            raise ValueError(f"imbalance must be an int >= 0, got {imbalance!r}")
        self.band, self.min_match, self.imbalance = band, min_match, imbalance
        self._sent: dict[ReplicaID, tuple[Any, int]] = {}  # replica -> (the report last seen, calls sent since)
        self._prefixes = PrefixTable()

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
        self._prefixes.retain(set(replicas))
        keys = prefix_keys(*request_text(pending_request))
        matches = {i: self._prefixes.match(i, keys) for i in replicas}
        ranked = prefer_prefix(rank(stats, sent, self.band), stats, sent, self.band, matches, len(keys),
                               self.min_match, self.imbalance)
        return [[replicas[i]] for i in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        report, sent = self._sent.get(replica_id, (None, 0))
        self._sent[replica_id] = (report, sent + 1)
        self._prefixes.add(replica_id, prefix_keys(*request_text(pending_request)))
