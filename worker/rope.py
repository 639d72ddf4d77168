"""Rotary position embeddings, with Llama 3 and linear frequency scaling."""

from __future__ import annotations

import math

import torch

from worker.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    # float32 throughout, as transformers computes it: the same frequencies bit for bit.
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_type == "linear":
        inv = inv / config.rope_scaling["factor"]
    elif config.rope_type == "llama3":
        inv = _llama3(inv, config.rope_scaling)
    return inv


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_len / low, inv / factor, inv)
    middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(middle, blended, out)


def rope_cache(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: cos in the first half, sin in the second."""
    t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(t, inv_frequencies(config))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def rope_for(cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) ``[tokens, 1, head_dim]`` in ``dtype`` for a step's positions: computed once per step."""
    half = cache.shape[-1] // 2
    freqs = cache[positions]
    cos, sin = freqs[:, :half], freqs[:, half:]
    return torch.cat([cos, cos], -1)[:, None].to(dtype), torch.cat([sin, sin], -1)[:, None].to(dtype)
