"""The engine deployment's replica ranking (``server.routing.rank``): free KV memory first, then load."""

from __future__ import annotations

import pytest

from server.routing import KVAwareRouter, rank


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
