"""A rolling update under streaming load: the engine replica being replaced lets its streams run to their ends; a
killed engine replica's successor gets the ingress's next request.

The ingress streams a request's tokens from the engine replica's scheduler actor after the replica's ``add`` call
has returned, so Serve, which counts calls in progress, sees an idle replica and would stop it at once. The
replica's drain (``EngineServer.__del__``) holds its workers until the requests it holds are done, up to
``drain_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import ray
from ray import serve

from cluster.config import EngineConfig
from server.app import AppConfig, build_app
from server.engine import scheduler_actors
from tests.server.conftest import serving, stream_to_end

ENGINE = EngineConfig(model="tiny", device="cpu", kv_memory=64 << 20, max_model_len=2048, page_size=4096,
                      distributed="ray")


def test_a_rolling_update_lets_every_stream_finish_on_the_replica_it_started_on():
    # Logical CPUs for both engine replicas (and their workers) while the new one starts beside the old.
    with serving(lambda: build_app(AppConfig(ENGINE, drain_timeout_s=120)), num_cpus=8) as url:
        (old,) = scheduler_actors()
        ends: list = []
        streams = [threading.Thread(target=stream_to_end, args=(url, ends, {"max_tokens": 1500})) for _ in range(4)]
        for t in streams:
            t.start()
        time.sleep(1.0)
        # A new engine config: Serve starts a replica of the new version, then stops the old one.
        serve.run(build_app(AppConfig(replace(ENGINE, max_num_seqs=9), drain_timeout_s=120)), route_prefix="/")
        for t in streams:
            t.join(120)
        assert ends == [("done", "length")] * 4
        (new,) = scheduler_actors()
        assert new != old  # the streams outlived the replica they started on


def test_the_ingress_sends_past_a_killed_engine_replica_to_its_successor():
    """With one engine replica the ingress sends its calls to the replica's scheduler actor itself. Once that
    replica is killed and Serve has started another, the next request goes to the new one, not to an error."""
    with serving(lambda: build_app(AppConfig(ENGINE))) as url:
        assert complete(url, "first") == 200  # the ingress learns the scheduler from this call
        ((old, _),) = scheduler_actors().items()
        ray.kill(ray.get_actor(f"SERVE_REPLICA::default#VattnEngine#{old}", namespace="serve"), no_restart=True)
        deadline = time.monotonic() + 180
        while not (actors := {k: a for k, a in scheduler_actors().items() if k != old}) or any(
                ray.get(a.health.remote(), timeout=30) != "ok" for a in actors.values()):
            assert time.monotonic() < deadline, "Serve started no new engine replica"
            time.sleep(0.5)
        assert complete(url, "second") == 200
        ((new, actor),) = actors.items()
        assert sum(ray.get(actor.snapshot.remote()).finished.values()) == 1


def complete(url: str, prompt: str) -> int:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).status_code
