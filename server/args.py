"""What a deployment of vattn is configured with: the arguments of ``vattn serve`` and of a Serve config file's
application (``serve_config.yaml``, the Helm chart's ``serveConfigV2``), one pydantic model for both."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.config import EngineConfig, parse_size
from server.serving import ServerSettings


class ServeArgs(BaseModel):
    """Sizes take ``"512MiB"``-style strings or bytes. ``api_key``: a key, several comma-separated, or a list (vLLM's
    ``--api-key`` takes several); unset: ``$VATTN_API_KEY`` (a Kubernetes Secret's way in, comma-separated too), else
    the API is open."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    tokenizer: str | None = None  # a directory with a tokenizer.json instead of the model's
    chat_template: str | None = None  # a Jinja template, or a file holding one, instead of the model's
    served_model_name: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    kv_layout: Literal["mega", "per_layer", "paged"] = "mega"
    attention: str | None = None
    kv_memory: int = 1 << 30
    kv_memory_fraction: float | None = Field(None, gt=0, le=1)  # instead of kv_memory: see EngineConfig
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)  # or this (vLLM's): see EngineConfig
    page_size: int = 2 << 20
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    dtype: str = "auto"
    device: Literal["cpu", "cuda"] | None = None
    load_format: Literal["auto", "dummy"] = "auto"
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs (vLLM's name)
    deterministic: bool = False  # batch-invariant kernels: a request's tokens do not depend on the batch
    eager_slots: int = Field(64, ge=0)  # free slots kept holding pages for new requests' prompts (0: off)
    mixed_graph_tokens: int | None = Field(None, ge=0)  # steps that prefill, up to this many, in CUDA graphs (0: eager; EngineConfig)
    fused_prefix_pages: int = Field(0, ge=0)  # cached prefixes this long fused on their first reuse (0: off; EngineConfig)
    num_replicas: int = Field(1, ge=1)
    ingress_replicas: int = Field(1, ge=1)  # HTTP front replicas: each takes a CPU, and SSE chunks cost CPU
    api_key: str | list[str] | None = None
    max_body: int = 4 << 20
    max_n: int = Field(16, ge=1)
    max_tokens_limit: int | None = Field(None, ge=1)
    max_pending: int = Field(1024, ge=1)
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None  # reads tool_choice "auto" answers (vLLM's flag)
    seed: int = 0  # random weights (dummy load), and the seeds of requests that bring none (vLLM's --seed)
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"  # replicas' logs
    drain_timeout_s: float = Field(60.0, gt=0)  # a replica being replaced lets its requests finish this long

    @classmethod
    def parse(cls, args: "dict | ServeArgs") -> "ServeArgs":
        """Validated ``args``; a ``ValueError`` naming each bad field otherwise."""
        try:
            return cls.model_validate(args)
        except ValidationError as exc:
            raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None

    @model_validator(mode="after")
    def _one_kv_size(self) -> "ServeArgs":
        given = [f"{name} ({getattr(self, name)}{' bytes' if name == 'kv_memory' else ''})"
                 for name in ("kv_memory", "kv_memory_fraction", "gpu_memory_utilization")
                 if name in self.model_fields_set and getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"set {' or '.join(given)}, not {'both' if len(given) == 2 else 'all'}")
        return self

    @field_validator("kv_memory", "page_size", "max_body", mode="before")
    @classmethod
    def _bytes(cls, value):
        return parse_size(value)

    def engine(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, kv_layout=self.kv_layout, attention=self.attention, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            kv_memory=self.kv_memory, kv_memory_fraction=self.kv_memory_fraction,
            gpu_memory_utilization=self.gpu_memory_utilization, page_size=self.page_size, dtype=self.dtype, device=self.device, progress=True, load_format=self.load_format,
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            distributed="ray", placement_strategy=self.placement_strategy, enable_prefix_caching=self.enable_prefix_caching,
            cuda_graphs=False if self.enforce_eager else None, seed=self.seed, tokenizer=self.tokenizer,
            chat_template=self.chat_template, deterministic=self.deterministic, eager_slots=self.eager_slots,
            mixed_graph_tokens=self.mixed_graph_tokens, fused_prefix_pages=self.fused_prefix_pages,
        )

    def settings(self) -> ServerSettings:
        given = self.api_key or os.environ.get("VATTN_API_KEY") or ""
        keys = tuple(k.strip() for part in ([given] if isinstance(given, str) else given) for k in part.split(","))
        return ServerSettings(api_keys=tuple(k for k in keys if k),
                              max_body_bytes=self.max_body, max_n=self.max_n, max_tokens=self.max_tokens_limit,
                              max_pending=self.max_pending, tool_call_parser=self.tool_call_parser)
