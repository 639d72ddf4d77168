"""The ``vattn`` command line.

    vattn generate --model tiny --prompt "Hello" [--prompt ...] [--max-tokens 32] [--temperature 0]
"""

from __future__ import annotations

import argparse
import json
import sys

from cluster.config import DTYPES, STRATEGIES
from cluster.errors import PlacementError
from cluster.engine import LLM
from kvmem.spec import LAYOUTS
from worker.attention import BACKENDS
from worker.config import PRESETS
from worker.sampling import SamplingParams


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vattn", description="LLM serving with a virtual-memory KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
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
    gen.add_argument("--kv-layout", choices=LAYOUTS, default="mega")
    gen.add_argument("--attention", choices=BACKENDS)
    gen.add_argument("--kv-memory", type=_size, default=1 << 30, help="physical KV pool, e.g. 512MiB or 20GiB")
    gen.add_argument("--max-num-seqs", type=int, default=64)
    gen.add_argument("--max-model-len", type=int)
    gen.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel workers per stage (Ray)")
    gen.add_argument("--pp", type=int, default=1, help="pipeline stages (Ray)")
    gen.add_argument("--distributed", choices=["local", "ray"],
                     help="default: ray when --tp or --pp > 1 (joins RAY_ADDRESS, else starts a local Ray)")
    gen.add_argument("--placement-strategy", choices=STRATEGIES, default="STRICT_PACK")
    gen.add_argument("--device")
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, n=args.n, stop=args.stop, ignore_eos=args.ignore_eos,
        )
        llm = LLM(
            args.model, kv_layout=args.kv_layout, attention=args.attention, kv_memory=args.kv_memory,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
            progress=True, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
            distributed=args.distributed or ("ray" if args.tp * args.pp > 1 else "local"),
            placement_strategy=args.placement_strategy,
        )
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


if __name__ == "__main__":
    sys.exit(main())
