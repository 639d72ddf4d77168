"""Building a model shard: Hugging Face checkpoints from a local directory, or random-weight presets."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from worker.config import PRESETS, ModelConfig
from worker.model import Transformer
from worker.parallel import TPGroup


def build_model(
    model: str,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tp: TPGroup = TPGroup(),
    layers: range | None = None,
    seed: int = 0,
    progress: bool = False,
    load_format: str = "auto",
) -> Transformer:
    """A preset name (random weights at real shapes) or a Hugging Face model directory: its weights, or with
    ``load_format="dummy"`` random ones at its ``config.json``'s shape (vLLM's option of that name)."""
    if model in PRESETS:
        return random_model(PRESETS[model], dtype, device, tp, layers, seed, progress)
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    config = ModelConfig.from_hf(path)
    if load_format == "dummy":
        return random_model(config, dtype, device, tp, layers, seed, progress)
    if load_format != "auto":
        raise ValueError(f"load_format {load_format!r}: choose 'auto' (the directory's weights) or 'dummy' (random)")
    shard = empty_model(config, dtype, device, tp, layers)
    load_hf_weights(shard, path, tp, progress)
    return shard


def empty_model(config: ModelConfig, dtype, device, tp: TPGroup = TPGroup(), layers: range | None = None) -> Transformer:
    """The shard's modules with uninitialised weights, allocated once on ``device`` in ``dtype``."""
    with torch.device("meta"):
        shard = Transformer(config, tp, layers).to(dtype)  # casting meta tensors costs nothing
    return shard.to_empty(device=device)


def random_model(
    config: ModelConfig, dtype, device, tp: TPGroup = TPGroup(), layers=None, seed: int = 0, progress: bool = False
) -> Transformer:
    """Random weights (normal, std 0.02; norms 1) at the preset's shape, made on ``device``.

    Each checkpoint tensor is drawn from its own generator, seeded by ``seed`` and its name, and then
    sharded as a checkpoint would be: every TP rank and PP stage holds its slice of one and the same model.
    """
    shard = empty_model(config, dtype, device, tp, layers)
    shapes = _hf_shapes(config)

    def lookup(name: str) -> torch.Tensor:
        shape = shapes[name.split(".", 3)[-1] if name.startswith("model.layers.") else name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)

    _copy_weights(shard, lookup, tp, progress)
    return shard


def _hf_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor shapes: per-layer names without their ``model.layers.{i}.`` prefix."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "self_attn.q_proj.weight": (q, c.hidden_size),
        "self_attn.k_proj.weight": (kv, c.hidden_size),
        "self_attn.v_proj.weight": (kv, c.hidden_size),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (c.hidden_size, q),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from the sharded index or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    out = {}
    for file in files:
        with safe_open(file, "pt") as f:
            out.update({name: file for name in f.keys()})
    return out


def _hf_names(shard: Transformer) -> dict[str, list[str]]:
    """Our parameter -> the checkpoint tensors it is made of (concatenated along rows)."""
    names: dict[str, list[str]] = {}
    for j, i in enumerate(shard.layer_range):
        hf, ours = f"model.layers.{i}.", f"layers.{j}."
        names[ours + "attention.wqkv.weight"] = [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if shard.config.qkv_bias:
            names[ours + "attention.wqkv.bias"] = [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
        names[ours + "attention.wo.weight"] = [hf + "self_attn.o_proj.weight"]
        names[ours + "feed_forward.w13.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        names[ours + "feed_forward.w2.weight"] = [hf + "mlp.down_proj.weight"]
        names[ours + "attention_norm.weight"] = [hf + "input_layernorm.weight"]
        names[ours + "ffn_norm.weight"] = [hf + "post_attention_layernorm.weight"]
    if shard.is_first:
        names["tok_embeddings.weight"] = ["model.embed_tokens.weight"]
    if shard.is_last:
        names["norm.weight"] = ["model.norm.weight"]
        tied = shard.config.tie_word_embeddings
        names["output.weight"] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return names


def _shard(name: str, tensor: torch.Tensor, tp: TPGroup, shape: torch.Size) -> torch.Tensor:
    """This rank's part: row-parallel weights split along inputs, column-parallel along outputs, the LM head by
    vocabulary rows where the model's ``shape`` says it is split (``Transformer.vocab_tp``)."""
    if tp.size == 1:
        return tensor
    if name.endswith(("wo.weight", "w2.weight")):
        return tensor.chunk(tp.size, dim=1)[tp.rank]
    if ".wqkv." in name or ".w13." in name or (name == "output.weight" and shape[0] * tp.size == tensor.shape[0]):
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    return tensor


def load_hf_weights(shard: Transformer, path: Path, tp: TPGroup = TPGroup(), progress: bool = False) -> None:
    """Copy a checkpoint directory's tensors into ``shard`` (this TP rank's slices)."""
    files = _weight_files(path)
    handles: dict[Path, object] = {}

    def lookup(name: str) -> torch.Tensor:
        if name not in files:
            raise FileNotFoundError(f"checkpoint {path} lacks {name}")
        return handles.setdefault(files[name], safe_open(files[name], "pt")).get_tensor(name)

    _copy_weights(shard, lookup, tp, progress)


def load_state_dict(shard: Transformer, state: dict[str, torch.Tensor], tp: TPGroup = TPGroup()) -> None:
    """Copy a transformers ``state_dict()`` (same names as the checkpoint files) into ``shard``."""

    def lookup(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"state dict lacks {name}")
        return state[name]

    _copy_weights(shard, lookup, tp, False)


def _copy_weights(shard: Transformer, lookup, tp: TPGroup, progress: bool) -> None:
    """Every parameter from its checkpoint tensors (q/k/v and gate/up split per rank, then joined),
    checking every shape."""
    params = dict(shard.named_parameters())
    for ours, theirs in tqdm(_hf_names(shard).items(), desc="loading weights", disable=not progress):
        tensor = torch.cat([_shard(ours, lookup(name), tp, params[ours].shape) for name in theirs], dim=0)
        if tensor.shape != params[ours].shape:
            raise ValueError(f"{ours}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[ours].shape)}")
        with torch.no_grad():
            params[ours].copy_(tensor)
