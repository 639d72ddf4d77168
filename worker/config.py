"""ModelConfig: the Llama-family shape, read from a Hugging Face ``config.json`` or a preset."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs; nothing about weights or devices."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported (default, linear, llama3)")

    @property
    def rope_type(self) -> str:
        """``rope_scaling``'s kind (``rope_type``, or the older ``type`` key), ``default`` without one."""
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    @property
    def max_context(self) -> int:
        """Longest sequence the model attends over correctly (Mistral's window caps it: no sliding here)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, source: str | Path | dict) -> "ModelConfig":
        """From a model directory, a ``config.json`` path, or its parsed dict."""
        raw = source if isinstance(source, dict) else _read_config(Path(source))
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED:
            archs = raw.get("architectures")
            raise ValueError(f"unsupported architecture {model_type!r} ({archs}); supported: {', '.join(SUPPORTED)}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        # transformers >= 5 writes rope_parameters (theta inside); older checkpoints rope_theta + rope_scaling.
        rope = raw.get("rope_parameters") or {}
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=raw.get("attention_bias", model_type == "qwen2"),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None,
            model_type=model_type,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


def _read_config(path: Path) -> dict:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {file}")
    return json.loads(file.read_text())


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(512, 128, 256, 2, 4, 2, 32, 2048, bos_token_id=256, eos_token_ids=(257,)),
    "llama-3-8b": ModelConfig(
        128256, 4096, 14336, 32, 32, 8, 128, 8192, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # Llama 3.1 8B: Llama 3's shape with its RoPE scaled to 128K positions (the paper's long-context model class).
    "llama-3.1-8b": ModelConfig(
        128256, 4096, 14336, 32, 32, 8, 128, 131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "yi-6b": ModelConfig(64000, 4096, 11008, 32, 32, 4, 128, 4096, rope_theta=5000000.0),
    "yi-34b": ModelConfig(64000, 7168, 20480, 60, 56, 8, 128, 4096, rope_theta=5000000.0),
    "qwen2.5-7b": ModelConfig(152064, 3584, 18944, 28, 28, 4, 128, 32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                              qkv_bias=True, model_type="qwen2"),
}
