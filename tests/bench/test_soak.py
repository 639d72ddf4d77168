"""bench/soak.py for two minutes, as CI runs it: ``vattn serve --model tiny`` (the real CLI, Ray, Serve, HAProxy) under
eight clients of mixed traffic with its worker actor killed every 40 s. No unexpected error; every killed worker
replaced and the engine serving again; after the drain no request left and no page holding tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_two_minutes_of_mixed_traffic_with_workers_killed_lose_nothing_unexpected(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH / "soak.py"), "--minutes", "2", "--clients", "8", "--sample-s", "15",
                          "--kill-every-s", "40", "--recover-s", "60", "--name", "soak_ci", "--out-dir", str(tmp_path),
                          "--log", str(tmp_path / "server.log")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "soak_ci.json").read_text())
    assert result["unexpected_errors"] == [], result["unexpected_errors"][:5]
    assert len(result["kills"]) == 2 and all(k["recovered_s"] is not None for k in result["kills"]), result["kills"]
    kinds = result["requests_by_kind"]
    assert all(kinds.get(kind, 0) > 0 for kind in result["mix"]), kinds  # every kind of traffic ran
    after = result["after_drain"]
    assert after["num_requests_running"] == after["num_requests_waiting"] == after["kv_slots_in_use"] == 0, after
    assert after["kv_used_bytes"] == 0, after
    assert (tmp_path / "soak_ci.png").stat().st_size > 0
