"""Tiny random Llama and Qwen2 checkpoints written by transformers, and the reference greedy outputs."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (5, 17, 33, 9, 40, 24)
NEW_TOKENS = 40


def _config(kind: str):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, bos_token_id=2)
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False), transformers.LlamaForCausalLM
    if kind == "llama3":  # Llama 3 RoPE scaling (short original context so that it matters here)
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}
        return transformers.LlamaConfig(**common, rope_scaling=scaling, rope_theta=500000.0), transformers.LlamaForCausalLM
    if kind == "llama128":  # 128-dim heads: the size FlashInfer's prebuilt kernels take
        return transformers.LlamaConfig(**{**common, "hidden_size": 512}), transformers.LlamaForCausalLM
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None), transformers.MistralForCausalLM
    return transformers.Qwen2Config(**common, tie_word_embeddings=True), transformers.Qwen2ForCausalLM


@pytest.fixture(scope="session", params=["llama", "llama3", "mistral", "qwen2"])
def hf_model(request, tmp_path_factory):
    """(checkpoint dir, prompts, HF greedy continuations) for a tiny random model."""
    return write_hf_model(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    """``hf_model`` for Llama alone."""
    return write_hf_model("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def hf_llama128(tmp_path_factory):
    """``hf_model`` for a Llama with 128-dim heads."""
    return write_hf_model("llama128", tmp_path_factory)


def write_hf_model(kind: str, tmp_path_factory):
    torch.manual_seed(0)
    config, cls = _config(kind)
    model = cls(config).eval()
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path, max_shard_size="100KB")  # several shards and an index file
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    return str(path), prompts, expected


def step_ranges(trace: str, prefix: str = "vattn_step_") -> list[str]:
    """The step ranges (or other ranges named ``prefix...``) of a worker's trace, in time order."""
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e["name"] for e in sorted(events, key=lambda e: e.get("ts", 0)) if e.get("name", "").startswith(prefix)]

