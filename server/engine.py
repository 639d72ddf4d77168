"""EngineServer: one engine replica of the Serve application -- a scheduler actor and its worker actors.

The replica takes requests (Serve routes each call to a replica: ``server.routing``) and hands the caller its
scheduler actor, from which the caller's ``server.outputs.OutputCollector`` then polls the outputs itself: the
tokens never pass through this replica, nor through a Serve stream item each. Where the replica is the deployment's
only one, the caller sends its next calls to that scheduler actor itself too, until the replica is stopped (its
drain refuses them, and the caller asks Serve again).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.actor import ActorHandle

from cluster.config import EngineConfig, model_config
from cluster.ray_engine import RayEngine
from cluster.ray_executor import Placement
from cluster.scheduler_actor import AddCall
from cluster.telemetry import EngineSnapshot
from worker.tokenizer import Tokenizer


#: Scheduler actors of engine replicas are named this and the replica's id (/metrics and /health find them).
SCHEDULER_PREFIX = "vattn-scheduler-"


def scheduler_actors() -> dict[str, ActorHandle]:
    """Every engine replica's scheduler actor, by replica id."""
    actors = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(SCHEDULER_PREFIX):
            try:
                actors[a["name"].removeprefix(SCHEDULER_PREFIX)] = ray.get_actor(a["name"], namespace=a["namespace"])
            except ValueError:  # gone since it was listed
                continue
    return actors


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    tokenizer: Tokenizer  # the engine's own (its chat template included), for the ingress to tokenize with
    vocab_size: int


@dataclass(frozen=True)
class SchedulerRef:
    """Where a call's requests went: the replica's scheduler actor and its name."""

    name: str
    actor: ActorHandle


class EngineServer:
    """The engine deployment's replica (``server.app`` wraps it in ``serve.deployment``)."""

    def __init__(self, config: EngineConfig, model_name: str, drain_timeout_s: float = 60.0):
        # The replica's placement group (Serve made it from ``placement_group_bundles``): bundle 0 holds this replica
        # and its scheduler actor, the rest its workers -- so Serve places a replica only where its GPUs are free.
        group = ray.util.get_current_placement_group()
        replica = serve.get_replica_context().replica_id.unique_id
        self.engine = RayEngine(config, Placement(group) if group is not None else None, SCHEDULER_PREFIX + replica)
        self.info = ModelInfo(model_name, self.engine.max_model_len, self.engine.tokenizer,
                              model_config(config.model).vocab_size)
        self.scheduler = SchedulerRef(SCHEDULER_PREFIX + replica, self.engine.actor)
        self._reports = 0
        self.drain_timeout_s = drain_timeout_s

    async def add(self, call: AddCall) -> SchedulerRef:
        """Queue ``call``'s requests on this replica's scheduler actor, whose polls then return their outputs. Bad
        input raises ``ValueError`` before anything is queued; a replica being stopped raises
        ``EngineDrainingError``."""
        await self.engine.actor.add.remote(call)
        return self.scheduler

    async def record_routing_stats(self) -> dict:
        """What ``server.routing.KVAwareRouter`` ranks replicas by (Serve asks every ``STATS_PERIOD_S``)."""
        snap = await self.engine.actor.snapshot.remote()
        self._reports += 1
        return {"kv_free": 1.0 - snap.kv_usage, "running": snap.num_running, "waiting": snap.num_waiting,
                "report": self._reports}

    async def model_info(self) -> ModelInfo:
        return self.info

    async def snapshot(self) -> EngineSnapshot:
        return await self.engine.actor.snapshot.remote()

    def __del__(self):
        """Serve stopping this replica (a rolling update, a scale-down, the app deleted) calls this on the replica's
        event loop: it returns the drain, which Serve awaits. Collected anywhere else, the engine closes at once."""
        if getattr(self, "engine", None) is None:
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._close()
            return None
        return self._drain()

    async def _drain(self) -> None:
        """Let the requests this replica's scheduler holds run to their ends and their outputs be collected, up to
        ``drain_timeout_s``, then close the engine. Serve counts only calls in progress, and the ingress streams a
        request's tokens from the scheduler actor after its ``add`` call has returned: without this a rolling update
        would cut every stream short."""
        deadline = time.monotonic() + self.drain_timeout_s
        await self.engine.actor.drain.remote()  # callers that send to the scheduler directly go to Serve instead
        while time.monotonic() < deadline and await self.engine.actor.in_flight.remote():
            await asyncio.sleep(0.1)
        self._close()

    def _close(self) -> None:
        engine, self.engine = self.engine, None
        engine.close()
