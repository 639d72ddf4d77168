"""A rolling update under streaming load: the engine replica being replaced lets its streams run to their ends.

The ingress streams a request's tokens from the engine replica's scheduler actor after the replica's ``add`` call
has returned, so Serve, which counts calls in progress, sees an idle replica and would stop it at once. The
replica's drain (``EngineServer.__del__``) holds its workers until the requests it holds are done, up to
``drain_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

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
