"""``vattn generate`` and the engine options every command shares (the ``vattn`` command itself, with ``serve``,
is ``server/cli.py``: the layer that holds both).

    vattn generate --model tiny --prompt "Hello" [--prompt ...] [--max-tokens 32] [--temperature 0]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from cluster.config import DTYPES, MIXED_GRAPH_TOKENS, STRATEGIES, parse_size as _size
from cluster.errors import PlacementError
from cluster.engine import LLM
from kvmem.spec import LAYOUTS
from worker.attention import BACKENDS
from worker.config import PRESETS
from worker.sampling import SamplingParams


#: The KV pool's share of what the weights leave on a GPU when no size is given (the chart's default too).
GPU_KV_FRACTION = 0.9


def add_generate(sub) -> None:
    """The ``generate`` subcommand on ``sub`` (an ``add_subparsers`` result)."""
    gen = sub.add_parser("generate", help="generate completions in-process")
    gen.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}) or HF model directory")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    engine_options(gen)
    gen.add_argument("--distributed", choices=["local", "ray"],
                     help="default: ray when --tp or --pp > 1 (joins RAY_ADDRESS, else starts a local Ray)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")


def engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's options, shared by ``generate`` and ``serve``."""
    parser.add_argument("--kv-layout", choices=LAYOUTS, default="mega")
    parser.add_argument("--attention", choices=BACKENDS)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--kv-memory", type=_size,
                      help="physical KV pool per worker, e.g. 512MiB or 20GiB (default: 1GiB on CPU, a share on a GPU)")
    size.add_argument("--kv-memory-fraction", type=float,
                      help=f"instead: this share of each worker's device memory left free by its weights (default on a "
                           f"GPU: {GPU_KV_FRACTION})")
    size.add_argument("--gpu-memory-utilization", type=float,
                      help="instead (vLLM's flag): the share of each GPU's whole memory the engine may use; the KV pool "
                           "takes what the weights leave of it")
    parser.add_argument("--page-size", type=_size, default=2 << 20, help="KV page of the virtual layouts")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens a step computes at most")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights at the model directory's config.json shape (benchmarks)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    parser.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel workers per stage (Ray)")
    parser.add_argument("--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int, default=1,
                        help="pipeline stages (Ray)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM's flag)")
    parser.add_argument("--placement-strategy", choices=STRATEGIES, default="STRICT_PACK")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV of prompt prefixes earlier requests computed (vLLM's flag; default on)")
    parser.add_argument("--mixed-graph-tokens", type=int, default=None,
                        help="with CUDA graphs, steps of up to this many tokens that prefill replay graphs too, where "
                             f"the attention backend allows it (fa3); 0: they run eagerly. Default: {MIXED_GRAPH_TOKENS} "
                             "on one GPU, 0 with --tp / --pp above 1")
    parser.add_argument("--eager-slots", type=int, default=64,
                        help="free slots kept holding pages for the next new requests, so that their prompts map "
                             "nothing in their step (virtual layouts; 0: off)")
    parser.add_argument("--fused-prefix-pages", type=int, default=0,
                        help="a cached prefix of at least this many pages, on its first reuse in another slot, is "
                             "copied into one allocation that later requests map in one driver call (virtual layouts; "
                             "0: off, each maps it a page at a time; being measured: docs/prefix-caching.md)")
    parser.add_argument("--deterministic", action="store_true",
                        help="the same request gives the same tokens whatever else is in the batch (batch-invariant "
                             "kernels, slower: docs/deterministic.md)")
    parser.add_argument("--device")


def kv_size(args: argparse.Namespace, device: str) -> dict:
    """The KV pool's size as given: a fixed ``kv_memory``, a fraction of what the weights leave, or vLLM's
    ``gpu_memory_utilization``; none: on a GPU ``GPU_KV_FRACTION`` of what the weights leave (as the chart), on CPU
    the engine's default."""
    if args.gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": args.gpu_memory_utilization}
    if args.kv_memory is None and args.kv_memory_fraction is None:
        return {"kv_memory_fraction": GPU_KV_FRACTION} if device == "cuda" else {}
    fixed = {"kv_memory": args.kv_memory} if args.kv_memory is not None else {}
    return {**fixed, "kv_memory_fraction": args.kv_memory_fraction}


def engine_config(args: argparse.Namespace, device: str) -> dict:
    """``EngineConfig`` keyword arguments from ``engine_options``' values, for ``device``."""
    return dict(kv_layout=args.kv_layout, attention=args.attention, **kv_size(args, device), page_size=args.page_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, load_format=args.load_format,
                tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, placement_strategy=args.placement_strategy,
                enable_prefix_caching=args.enable_prefix_caching, cuda_graphs=False if args.enforce_eager else None,
                deterministic=args.deterministic, eager_slots=args.eager_slots,
                mixed_graph_tokens=args.mixed_graph_tokens, fused_prefix_pages=args.fused_prefix_pages)


def generate(args: argparse.Namespace) -> int:
    """``vattn generate``: the prompts through an in-process (or Ray) engine, printed; the exit status."""
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, n=args.n, stop=args.stop, ignore_eos=args.ignore_eos,
        )
        llm = LLM(args.model, progress=True, distributed=args.distributed or ("ray" if args.tp * args.pp > 1 else "local"),
                  **engine_config(args, args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    except (ValueError, FileNotFoundError, ImportError, PlacementError) as exc:  # ImportError: an attention backend's package
        print(f"vattn: error: {exc}", file=sys.stderr)
        return 2
    with llm:
        prompts = args.prompt
        if args.chat:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        try:
            outputs = llm.generate(prompts, params, use_tqdm=True)
        except ValueError as exc:
            print(f"vattn: error: {exc}", file=sys.stderr)
            return 2
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "completions": [
                {"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason} for c in out.outputs
            ]}))
            continue
        for c in out.outputs:
            print(f"--- {out.prompt!r} [{c.index}] ({c.finish_reason}, {len(c.token_ids)} tokens)\n{c.text}")
    return 0
