"""The Ray Serve application: an ingress deployment (the OpenAI API) in front of engine deployments, each
replica of which owns a scheduler actor and its worker actors (``num_replicas`` > 1: data parallel)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import LoggingConfig

from cluster.config import EngineConfig
from cluster.config import model_config as model_config_of
from server.api import BodyLimit, build_api
from server.args import ServeArgs
from server.engine import EngineServer
from server.outputs import OutputCollector
from server.routing import STATS_PERIOD_S, KVAwareRouter
from server.serving import ServerSettings
from worker.heap import freeze_heap

DRAIN_MARGIN_S = 10.0  # past a replica's drain, for closing its workers before Serve kills it


@dataclass(frozen=True)
class AppConfig:
    engine: EngineConfig
    model_name: str | None = None  # default: the preset's name or the model directory's
    settings: ServerSettings = field(default_factory=ServerSettings)
    num_replicas: int = 1
    ingress_replicas: int = 1
    log_level: str = "info"  # the replicas' (vLLM's --uvicorn-log-level): access lines at info and below
    # A replica Serve stops (a rolling update, a scale-down, the app deleted) lets the requests it holds run to their
    # ends this long; Serve kills it DRAIN_MARGIN_S after that.
    drain_timeout_s: float = 60.0

    def logging(self) -> LoggingConfig:
        """What Serve's replicas log: ``trace`` is uvicorn's name for more than debug, which Python's logging lacks."""
        return LoggingConfig(log_level="DEBUG" if self.log_level == "trace" else self.log_level.upper(),
                             enable_access_log=self.log_level in ("info", "debug", "trace"))

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.engine.model).name or self.engine.model


@serve.ingress()
class OpenAIIngress:
    """The HTTP front: built once the engine can say what it serves."""

    def __init__(self, engine: DeploymentHandle, settings: ServerSettings, num_replicas: int):
        self.engine, self.settings, self.num_replicas = engine, settings, num_replicas

    async def __serve_build_asgi_app__(self):
        info = await self.engine.model_info.remote()
        # The engine's tokenizer, so that prompts and chats are tokenized here and not in the engine's process
        # (vLLM's API server does the same): the step loop's process pays for no request's text.
        collector = OutputCollector(self.engine, "ingress-" + serve.get_replica_context().replica_id.unique_id,
                                    info.tokenizer, info.vocab_size, direct=self.num_replicas == 1)
        app = build_api(collector, self.settings, info.name, info.max_model_len, self.num_replicas)
        app.add_middleware(BodyLimit, limit=self.settings.max_body_bytes)
        freeze_heap("ingress")  # a full collection here would hold every stream this replica serves
        return app


def build_app(config: AppConfig) -> Application:
    """Each engine replica declares its workers as placement-group bundles (one CPU for the replica and its
    scheduler actor, then a GPU and a CPU per worker, or a CPU on CPU), so Serve starts a replica only where
    they all fit. ``engine.device`` None: CUDA when the Ray cluster has GPUs."""
    if not isinstance(config.num_replicas, int) or config.num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {config.num_replicas!r}")
    e = config.engine
    device = e.device or ("cuda" if ray.is_initialized() and ray.cluster_resources().get("GPU") else "cpu")
    worker = {"GPU": 1.0, "CPU": 1.0} if device == "cuda" else {"CPU": 1.0}
    bundles = [{"CPU": 1.0}] + [worker] * (e.tensor_parallel_size * e.pipeline_parallel_size)
    if not config.drain_timeout_s > 0:
        raise ValueError(f"drain_timeout_s must be > 0, got {config.drain_timeout_s!r}")
    drain = dict(graceful_shutdown_timeout_s=config.drain_timeout_s + DRAIN_MARGIN_S, graceful_shutdown_wait_loop_s=0.5)
    engine = serve.deployment(EngineServer, name="VattnEngine", num_replicas=config.num_replicas, **drain,
                              ray_actor_options={"num_cpus": 1}, placement_group_bundles=bundles,
                              placement_group_strategy=e.placement_strategy, max_ongoing_requests=100_000,
                              logging_config=config.logging(),
                              request_router_config=RequestRouterConfig(request_router_class=KVAwareRouter,
                                                                        request_routing_stats_period_s=STATS_PERIOD_S))
    if not isinstance(config.ingress_replicas, int) or config.ingress_replicas < 1:
        raise ValueError(f"ingress_replicas must be an int >= 1, got {config.ingress_replicas!r}")
    ingress = serve.deployment(OpenAIIngress, name="VattnIngress", num_replicas=config.ingress_replicas, **drain,
                               max_ongoing_requests=100_000, logging_config=config.logging())
    return ingress.bind(engine.bind(replace(e, device=device), config.served_name, config.drain_timeout_s),
                        config.settings, config.num_replicas)


def app_builder(args: dict | ServeArgs) -> Application:
    """The application a Serve config file names (``import_path: server.app:app_builder``), from its ``args``.
    Bad arguments raise ``ValueError`` naming them before anything starts."""
    a = ServeArgs.parse(args)
    engine = a.engine()
    model_config_of(engine.model)  # a missing model directory fails here, not in a replica
    return build_app(AppConfig(engine, a.served_model_name, a.settings(), a.num_replicas, a.ingress_replicas,
                               a.uvicorn_log_level, a.drain_timeout_s))
