"""The ``vattn`` command line.

    vattn generate --model tiny --prompt "Hello" [--prompt ...] [--max-tokens 32] [--temperature 0]
    vattn serve --model DIR [--port 8000] [--tp 2] [--api-key KEY]   # the OpenAI-compatible API on Ray Serve
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cluster.config import DTYPES, STRATEGIES, parse_size as _size
from cluster.errors import PlacementError
from cluster.engine import LLM
from kvmem.spec import LAYOUTS
from worker.attention import BACKENDS
from worker.config import PRESETS
from worker.sampling import SamplingParams


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
    _engine_options(gen)
    gen.add_argument("--distributed", choices=["local", "ray"],
                     help="default: ray when --tp or --pp > 1 (joins RAY_ADDRESS, else starts a local Ray)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on Ray Serve")
    srv.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}) or HF model directory")
    srv.add_argument("--served-model-name", help="the name clients use (default: the model directory's name)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=os.environ.get("VATTN_API_KEY"),
                     help="required as 'Authorization: Bearer KEY' on /v1/* (default: $VATTN_API_KEY; unset: open)")
    srv.add_argument("--num-replicas", type=int, default=1, help="engine replicas (data parallel)")
    srv.add_argument("--ingress-replicas", type=int, default=1, help="HTTP front replicas (more for many streams)")
    srv.add_argument("--max-body", type=_size, default=4 << 20, help="largest request body")
    srv.add_argument("--max-n", type=int, default=16)
    srv.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask (default: the context)")
    srv.add_argument("--max-pending", type=int, default=1024, help="requests held at once; more get 429")
    _engine_options(srv)
    return parser


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-layout", choices=LAYOUTS, default="mega")
    parser.add_argument("--attention", choices=BACKENDS)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--kv-memory", type=_size, help="physical KV pool per worker, e.g. 512MiB or 20GiB (default 1GiB)")
    size.add_argument("--kv-memory-fraction", type=float,
                      help="instead: this share of each worker's device memory left free by its weights, e.g. 0.9")
    parser.add_argument("--page-size", type=_size, default=2 << 20, help="KV page of the virtual layouts")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens a step computes at most")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights at the model directory's config.json shape (benchmarks)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel workers per stage (Ray)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (Ray)")
    parser.add_argument("--placement-strategy", choices=STRATEGIES, default="STRICT_PACK")
    parser.add_argument("--device")


def _kv_size(args: argparse.Namespace) -> dict:
    """The KV pool's size as given: a fixed ``kv_memory`` (else the engine's default) or a fraction."""
    fixed = {"kv_memory": args.kv_memory} if args.kv_memory is not None else {}
    return {**fixed, "kv_memory_fraction": args.kv_memory_fraction}


def _engine_config(args: argparse.Namespace) -> dict:
    return dict(kv_layout=args.kv_layout, attention=args.attention, **_kv_size(args), page_size=args.page_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, load_format=args.load_format,
                tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, placement_strategy=args.placement_strategy)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, n=args.n, stop=args.stop, ignore_eos=args.ignore_eos,
        )
        llm = LLM(args.model, progress=True, distributed=args.distributed or ("ray" if args.tp * args.pp > 1 else "local"),
                  **_engine_config(args))
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


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    import torch

    from cluster.config import model_config, plan
    from server.app import app_builder
    from server.args import ServeArgs

    try:
        serve_args = ServeArgs.parse(dict(
            model=args.model, served_model_name=args.served_model_name, tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp, kv_layout=args.kv_layout, attention=args.attention, **_kv_size(args),
            page_size=args.page_size, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, load_format=args.load_format,
            placement_strategy=args.placement_strategy, num_replicas=args.num_replicas,
            ingress_replicas=args.ingress_replicas,
            api_key=args.api_key, max_body=args.max_body, max_n=args.max_n, max_tokens_limit=args.max_tokens_limit,
            max_pending=args.max_pending,
        ))
        engine = serve_args.engine()
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        plan(engine, model_config(args.model), device)  # bad options fail here, before Ray starts
        app = app_builder(serve_args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"vattn: error: {exc}", file=sys.stderr)
        return 2
    if not os.environ.get("RAY_ADDRESS"):
        # Logical CPUs for the ingress replicas, and per engine replica one for it and one per worker, however few cores.
        needed = args.ingress_replicas + args.num_replicas * (1 + args.tp * args.pp)
        ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    try:
        serve.run(app, route_prefix="/")
    except Exception as exc:
        print(f"vattn: error: the app did not start: {exc}", file=sys.stderr)
        serve.shutdown()
        return 1
    name = args.served_model_name or Path(args.model).name or args.model
    auth = f' -H "Authorization: Bearer {args.api_key}"' if args.api_key else ""
    print(f"\nvattn serves {name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C stops it). Try:\n"
          f"  curl http://{args.host}:{args.port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          f"""-d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'\n""",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
