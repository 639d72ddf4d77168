"""The Llama family (Llama 2/3, Mistral, Qwen2) in one file: RMSNorm, RoPE, GQA attention, SwiGLU.

Tokens of all sequences in a step are one flat batch ``[tokens, hidden]``; attention goes through an
``AttentionStep`` that stores the new K/V in the cache and attends over it. A pipeline stage owns a range
of layers; with ``TPGroup(size>1)`` heads and the MLP are split over ranks.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from worker.attention import AttentionStep
from worker.config import ModelConfig
from worker.parallel import ColumnParallelLinear, Linear, RowParallelLinear, TPGroup
from worker.kernels import rms_norm, rope_qk, silu_mul

Rope = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, tp: TPGroup | None = None):
        """The norm of ``x``; with ``residual``, ``(x + residual, its norm)`` (one kernel on CUDA); with ``tp``, ``x``
        is this rank's part of a row-parallel product, summed over the ranks first (``TPGroup.add_norm``)."""
        if tp is not None:
            return tp.add_norm(x, residual, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup):
        """``layer``: this shard's index of the layer, which is also its layer in this shard's KV cache."""
        super().__init__()
        self.layer = layer
        self.n_heads = tp.split(config.num_heads, "num_heads")
        self.n_kv_heads = tp.split(config.num_kv_heads, "num_kv_heads")
        self.head_dim = config.head_dim
        qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.wqkv = ColumnParallelLinear(config.hidden_size, qkv, config.qkv_bias, tp)
        self.wo = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, tp)

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionStep) -> torch.Tensor:
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qkv = self.wqkv(x)
        q, k = rope_qk(qkv, self.n_heads, self.n_kv_heads, self.head_dim, *rope)
        v = qkv[:, q_size + kv_size:].view(-1, self.n_kv_heads, self.head_dim)
        out = attn(self.layer, q, k, v)
        return self.wo(out.reshape(-1, q_size))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.w13 = ColumnParallelLinear(config.hidden_size, 2 * config.intermediate_size, False, tp)
        self.w2 = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu_mul(self.w13(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer, tp)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config, tp)
        # The row-parallel products' outputs are this rank's parts, summed by the norms after them (one kernel each)
        self.sums_in_norms = tp if tp.fuses_norms else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, attn: AttentionStep):
        """``x`` the block before's output and ``residual`` the stream before that block (``None``: ``x`` is the
        stream) -> this block's ``(output, residual)``. The stream after a block is their sum, which the next
        block's norm adds in its kernel: one elementwise pass fewer a layer. With ``sums_in_norms`` a block's output is
        this rank's part, which the next block's norm sums over the ranks in that kernel too."""
        tp = self.sums_in_norms
        residual, normed = ((x, self.attention_norm(x)) if residual is None
                            else self.attention_norm(x, residual=residual, tp=tp))
        h, normed = self.ffn_norm(self.attention(normed, rope, attn), residual=residual, tp=tp)
        return self.feed_forward(normed), h


def splits_lm_head() -> bool:
    """Whether TP ranks split the LM head by vocabulary rows: yes unless ``VATTN_SPLIT_LM_HEAD=0``, which keeps it whole
    on every rank, to measure one against the other. Split, it took 0.13 ms off a TP=2 decode step of 6.6 ms on
    2xH200, the whole head in the same call (docs/performance.md, "Two GPUs")."""
    return os.environ.get("VATTN_SPLIT_LM_HEAD", "1") != "0"


class Transformer(nn.Module):
    """Layers ``layers`` of the model (all of them by default); the first stage embeds, the last
    normalises and produces logits."""

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(), layers: range | None = None):
        super().__init__()
        self.config = config
        self.layer_range = layers if layers is not None else range(config.num_layers)
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == config.num_layers
        # The embedding stays whole on every TP rank (a lookup: small next to the layers). The LM head is split by
        # vocabulary rows where the vocabulary divides (vLLM's ParallelLMHead; ``splits_lm_head``).
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size) if self.is_first else None
        split = splits_lm_head() and self.is_last and tp.size > 1 and config.vocab_size % tp.size == 0
        self.vocab_tp = tp if split else None
        self.layers = nn.ModuleList(Block(config, j, tp) for j in range(len(self.layer_range)))
        self.sums_in_norms = tp if tp.fuses_norms else None  # the last block's output: this rank's part
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.output = Linear(config.hidden_size, config.vocab_size // (tp.size if self.vocab_tp else 1), bias=False)

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionStep) -> torch.Tensor:
        """``x``: token ids ``[tokens]`` on the first stage, hidden states ``[tokens, hidden]`` after;
        ``rope``: (cos, sin) of the tokens' positions (``rope_for``)."""
        h, residual = self.tok_embeddings(x) if self.is_first else x, None
        for block in self.layers:
            h, residual = block(h, residual, rope, attn)
        if residual is None:
            return h
        return (self.sums_in_norms.all_reduce(h) if self.sums_in_norms is not None else h) + residual

    def set_batch_invariant(self, on: bool) -> None:
        """Every matmul batch-invariant (``worker.batch_invariant``) or the library's, from now on (the worker
        that runs the model sets it: ``deterministic=True``). The other kernels are batch-invariant either way:
        RMSNorm and the sampler reduce within a row, the rest is elementwise."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.batch_invariant = on

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's output in the model's dtype: a greedy step's argmax and the sampler's draw read it as it is
        (converting to float32 is exact, so it picks the same tokens); what adds to or normalises logits upcasts
        first (``ModelRunner._sample``). Converting every step's logits cost a copy kernel of 0.11 ms a decode
        step at 256 rows of a 128K vocabulary (docs/performance.md). With ``vocab_tp`` this rank's slice of the
        vocabulary: ``whole`` makes the rows whole, ``vocab_tp.argmax_columns`` picks greedy tokens from the slices."""
        return self.output(self.norm(h))

    def whole(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits``' rows over the whole vocabulary (every TP rank must call it where the LM head is split)."""
        return self.vocab_tp.gather_columns(logits) if self.vocab_tp is not None else logits
