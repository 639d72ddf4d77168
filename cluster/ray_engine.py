"""RayEngine: the client side of ``LLM(distributed="ray")`` -- joins or starts Ray, checks the request
against the cluster before anything starts, and talks to the scheduler actor."""

from __future__ import annotations

import os
from dataclasses import replace

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.scheduler_actor import SchedulerActor
from cluster.config import EngineConfig, model_config, plan
from cluster.outputs import RequestOutput
from cluster.ray_executor import Placement
from cluster.telemetry import EngineSnapshot
from kvmem.stats import SlotAccounting
from worker.sampling import SamplingParams
from worker.tokenizer import load_tokenizer


def _get(ref, timeout: float | None = None):
    """``ray.get`` that raises the remote method's own exception (a ``ValueError`` stays one)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        raise (exc.cause if exc.cause is not None else exc) from None


class RayEngine:
    def __init__(self, config: EngineConfig, placement: Placement | None = None, name: str | None = None):
        """``placement``: bundles for the scheduler actor (the first) and the workers (the rest), e.g. a Serve
        replica's own placement group; else the workers get a group of their own. ``name``: the scheduler
        actor's, for others to find it (the metrics endpoint)."""
        self._started_ray = False
        if not ray.is_initialized():
            workers = config.tensor_parallel_size * config.pipeline_parallel_size
            if os.environ.get("RAY_ADDRESS"):
                ray.init()
            else:  # a local cluster: one logical CPU per CPU worker however few cores there are
                ray.init(num_cpus=max(os.cpu_count() or 1, workers + 1), include_dashboard=False)
                self._started_ray = True
        try:
            self._start(config, placement, name)
        except BaseException:
            if self._started_ray:
                ray.shutdown()
            raise

    def _start(self, config: EngineConfig, placement: Placement | None, name: str | None) -> None:
        n = config.tensor_parallel_size * config.pipeline_parallel_size
        gpus = int(ray.cluster_resources().get("GPU", 0))
        device = config.device or ("cuda" if gpus else "cpu")
        engine_plan = plan(config, model_config(config.model), device)  # bad input fails here, nothing started
        if device == "cuda" and n > gpus:
            raise ValueError(f"tp={config.tensor_parallel_size} x pp={config.pipeline_parallel_size} needs {n} GPUs; "
                             f"the Ray cluster has {gpus}")
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if device == "cpu" and n > cpus:
            raise ValueError(f"{n} CPU workers need {n} CPUs of the Ray cluster; it has {cpus}")
        self.tokenizer = load_tokenizer(config.model, engine_plan.model.eos_token_ids, config.tokenizer,
                                        config.chat_template)
        self.max_model_len = engine_plan.max_model_len
        self.plan = engine_plan
        options = {"name": name} if name else {}
        if placement is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement.group, placement.first_bundle)
            placement = replace(placement, first_bundle=placement.first_bundle + 1)
        self.actor = SchedulerActor.options(max_concurrency=32, **options).remote(replace(config, device=device), placement)
        try:
            _get(self.actor.ready.remote())
        except BaseException:
            ray.kill(self.actor)
            raise

    def add_requests(self, prompts: list, params: list[SamplingParams | None], stream: bool = False) -> list[str]:
        return _get(self.actor.add_requests.remote(prompts, params, stream))

    def poll(self, pending: set[str], finished_only: bool) -> list[RequestOutput]:
        return _get(self.actor.wait_outputs.remote(sorted(pending), 1.0))

    def abort(self, request_id: str) -> None:
        _get(self.actor.abort.remote(request_id))

    def snapshot(self) -> EngineSnapshot:
        return _get(self.actor.snapshot.remote())

    def reset_prefix_cache(self) -> int:
        return _get(self.actor.reset_prefix_cache.remote())

    def start_profile(self, directory: str) -> None:
        _get(self.actor.start_profile.remote(directory))

    def stop_profile(self) -> list[str]:
        return _get(self.actor.stop_profile.remote())

    def worker_accounting(self) -> list[SlotAccounting]:
        """Each worker's slot accounting, then the scheduler's ledger's."""
        return _get(self.actor.worker_accounting.remote())

    def close(self) -> None:
        if self.actor is None:
            return
        try:
            _get(self.actor.shutdown.remote(), timeout=120)
        finally:
            ray.kill(self.actor)
            self.actor = None
            if self._started_ray:
                ray.shutdown()
