"""The Ray Serve application: an ingress deployment (the OpenAI API) in front of engine deployments, each
replica of which owns a scheduler actor and its worker actors (``num_replicas`` > 1: data parallel)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from cluster.config import EngineConfig
from server.api import BodyLimit, ServerSettings, build_api
from server.engine import EngineServer


@dataclass(frozen=True)
class AppConfig:
    engine: EngineConfig
    model_name: str | None = None  # default: the preset's name or the model directory's
    settings: ServerSettings = field(default_factory=ServerSettings)
    num_replicas: int = 1

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.engine.model).name or self.engine.model


@serve.ingress()
class OpenAIIngress:
    """The HTTP front: built once the engine can say what it serves."""

    def __init__(self, engine: DeploymentHandle, settings: ServerSettings):
        self.engine, self.settings = engine, settings

    async def __serve_build_asgi_app__(self):
        info = await self.engine.model_info.remote()
        app = build_api(self.engine, self.settings, info.name, info.max_model_len)
        app.add_middleware(BodyLimit, limit=self.settings.max_body_bytes)
        return app


def build_app(config: AppConfig) -> Application:
    if not isinstance(config.num_replicas, int) or config.num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {config.num_replicas!r}")
    engine = serve.deployment(EngineServer, name="VattnEngine", num_replicas=config.num_replicas,
                              ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    ingress = serve.deployment(OpenAIIngress, name="VattnIngress", max_ongoing_requests=100_000)
    return ingress.bind(engine.bind(config.engine, config.served_name), config.settings)
