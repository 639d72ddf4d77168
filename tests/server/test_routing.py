"""The engine deployment's replica ranking (``server.routing``): free KV memory first, then load; a replica that got
the start of a request before comes first while it has room and is not overloaded."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from cluster.scheduler_actor import AddCall
from server.routing import (CHUNK_CHARS, KVAwareRouter, PrefixTable, prefer_prefix, prefix_keys, rank,
                            request_text)
from worker.sampling import SamplingParams


def test_free_kv_memory_outranks_load():
    stats = {"full": {"kv_free": 0.3, "running": 1, "waiting": 0}, "roomy": {"kv_free": 0.9, "running": 5, "waiting": 2}}
    assert rank(stats, {}, band=0.1) == ["roomy", "full"]


def test_within_the_band_the_fewest_requests_win_counting_those_sent_since_the_report():
    stats = {"a": {"kv_free": 0.95, "running": 3, "waiting": 0}, "b": {"kv_free": 0.90, "running": 1, "waiting": 1}}
    assert rank(stats, {}, band=0.1) == ["b", "a"]
    assert rank(stats, {"b": 2}, band=0.1) == ["a", "b"]  # 3 against 4
    assert rank(stats, {}, band=0.0) == ["a", "b"]  # no band: the freest wins


def test_replicas_without_a_report_count_as_empty():
    stats = {"new": {}, "busy": {"kv_free": 1.0, "running": 2}}
    assert rank(stats, {}, band=0.1) == ["new", "busy"]
    assert set(rank({"x": {}, "y": {}}, {}, band=0.1)) == {"x", "y"}


def test_a_band_outside_0_1_is_refused():
    router = KVAwareRouter.__new__(KVAwareRouter)  # initialize_state is Serve's hook, called after __init__
    with pytest.raises(ValueError, match=r"band must be in \[0, 1\], got 1.5"):
        router.initialize_state(band=1.5)


SYSTEM = "You are a careful assistant. Answer in one sentence, cite nothing, and never repeat the question. " * 3


def pending(*args, **kwargs) -> PendingRequest:
    """The request the ingress's handle sends: ``EngineServer.add``'s arguments (made in an event loop, as Serve's
    router makes it: it holds a future)."""
    async def make() -> PendingRequest:
        return PendingRequest(list(args), kwargs, RequestMetadata(request_id="r", internal_request_id="r",
                                                                  call_method="add"))

    return asyncio.run(make())


def test_the_router_reads_a_requests_start_from_the_engines_add_call():
    params = SamplingParams(max_tokens=4)
    assert request_text(pending(AddCall([SYSTEM + "hi"], params, False, ("1",), "c"))) == (SYSTEM + "hi", None)
    # what the ingress sends: token ids (a chat's through its template)
    assert request_text(pending(AddCall([[5, 6, 7]], params, False, ("1",), "c", cache_salt="t"))) == ("5,6,7", "t")
    assert request_text(pending()) == ("", None)  # model_info, snapshot, ...
    assert request_text(pending("not", "the", "add", "call")) == ("", None)


def test_prefix_keys_are_chained_whole_chunks_and_salted():
    keys = prefix_keys(SYSTEM)
    assert len(keys) == len(SYSTEM) // CHUNK_CHARS
    assert prefix_keys(SYSTEM + "another question")[: len(keys)] == keys
    assert prefix_keys("x" + SYSTEM)[1:] != keys[1:]  # a chunk's key covers everything before it
    assert not set(prefix_keys(SYSTEM, "tenant")) & set(keys)


def test_the_table_matches_leading_keys_and_forgets_the_least_recently_routed():
    table = PrefixTable(capacity=4)
    table.add("a", [1, 2, 3])
    assert table.match("a", [1, 2, 9]) == 2 and table.match("b", [1]) == 0
    table.add("a", [7, 8])  # 5 keys: 1 goes
    assert table.match("a", [1, 2]) == 0 and table.match("a", [7, 8]) == 2
    table.retain({"b"})
    assert table.match("a", [7]) == 0


def test_the_replica_holding_the_prefix_comes_first_unless_it_is_short_of_memory_or_overloaded():
    stats = {"a": {"kv_free": 0.8, "running": 4}, "b": {"kv_free": 0.9, "running": 1}}
    ranked = rank(stats, {}, band=0.1)
    assert ranked == ["b", "a"]
    kw = dict(band=0.1, total=10, min_match=0.1, imbalance=4)
    assert prefer_prefix(ranked, stats, {}, matches={"a": 6}, **kw) == ["a", "b"]
    assert prefer_prefix(ranked, stats, {}, matches={"a": 0}, **kw) == ["b", "a"]  # nothing in common
    assert prefer_prefix(ranked, stats, {"a": 2}, matches={"a": 6}, **kw) == ["b", "a"]  # 6 requests against 1
    short = {**stats, "a": {"kv_free": 0.5, "running": 1}}
    assert prefer_prefix(rank(short, {}, 0.1), short, {}, matches={"a": 6}, **kw) == ["b", "a"]
    assert prefer_prefix(ranked, stats, {}, matches={"a": 6}, **{**kw, "min_match": 0.7}) == ["b", "a"]


def test_prefix_affinity_settings_are_checked():
    router = KVAwareRouter.__new__(KVAwareRouter)
    with pytest.raises(ValueError, match=r"min_match must be in \(0, 1\], got 0"):
        router.initialize_state(min_match=0)
    with pytest.raises(ValueError, match="imbalance must be an int >= 0, got -1"):
        router.initialize_state(imbalance=-1)
