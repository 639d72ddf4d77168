"""The ``vattn`` command line: ``generate`` (``cluster/cli.py``) and ``serve``, the OpenAI-compatible API on Ray Serve.

    vattn generate --model tiny --prompt "Hello" [--prompt ...] [--max-tokens 32] [--temperature 0]
    vattn serve --model DIR [--port 8000] [--tp 2] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from cluster.cli import add_generate, engine_options, generate, kv_size
from cluster.config import parse_size as _size
from worker.config import PRESETS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vattn", description="LLM serving with a virtual-memory KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on Ray Serve")
    srv.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}) or HF model directory")
    srv.add_argument("--served-model-name", help="the name clients use (default: the model directory's name)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", action="append",
                     help="required as 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /dashboard; repeat "
                          "it (or separate by commas) for several (default: $VATTN_API_KEY; unset: open)")
    srv.add_argument("--num-replicas", type=int, default=1, help="engine replicas (data parallel)")
    srv.add_argument("--ingress-replicas", type=int, default=1, help="HTTP front replicas (more for many streams)")
    srv.add_argument("--max-body", type=_size, default=4 << 20, help="largest request body")
    srv.add_argument("--max-n", type=int, default=16)
    srv.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask (default: the context)")
    srv.add_argument("--max-pending", type=int, default=1024, help="requests held at once; more get 429")
    srv.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"],
                     help="how answers to tool_choice 'auto' are read: hermes (Hermes, Qwen 2.5) or llama3_json (vLLM's "
                          "flag; without it 'auto' with tools is refused, 'required' and named functions need none)")
    srv.add_argument("--tokenizer", help="a directory with a tokenizer.json, instead of the model's (vLLM's flag)")
    srv.add_argument("--chat-template", help="a Jinja chat template, or a file holding one, instead of the model's")
    srv.add_argument("--seed", type=int, default=0,
                     help="seeds the requests that bring none, and dummy weights (vLLM's flag)")
    srv.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                     default="info", help="what the server's replicas log; below info, no access lines (vLLM's flag)")
    srv.add_argument("--drain-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="how long a replica being replaced or stopped lets the requests it holds finish")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM command lines: --tool-call-parser alone turns 'auto' on")
    engine_options(srv)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _serve(args) if args.command == "serve" else generate(args)


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    import torch

    from cluster.config import model_config, plan
    from server.app import app_builder
    from server.args import ServeArgs
    from server.serve_env import local_cluster_env
    from worker.tokenizer import load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        serve_args = ServeArgs.parse(dict(
            model=args.model, served_model_name=args.served_model_name, tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp, kv_layout=args.kv_layout, attention=args.attention, **kv_size(args, device),
            page_size=args.page_size, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, load_format=args.load_format,
            placement_strategy=args.placement_strategy, enable_prefix_caching=args.enable_prefix_caching,
            enforce_eager=args.enforce_eager, deterministic=args.deterministic, eager_slots=args.eager_slots,
            mixed_graph_tokens=args.mixed_graph_tokens, fused_prefix_pages=args.fused_prefix_pages,
            num_replicas=args.num_replicas,
            ingress_replicas=args.ingress_replicas,
            api_key=args.api_key, max_body=args.max_body, max_n=args.max_n, max_tokens_limit=args.max_tokens_limit,
            max_pending=args.max_pending, tool_call_parser=args.tool_call_parser, seed=args.seed,
            tokenizer=args.tokenizer, chat_template=args.chat_template, uvicorn_log_level=args.uvicorn_log_level,
            drain_timeout_s=args.drain_timeout,
        ))
        engine = serve_args.engine()
        plan(engine, model_config(args.model), device)  # bad options fail here, before Ray starts
        load_tokenizer(args.model, (), args.tokenizer, args.chat_template)
        app = app_builder(serve_args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"vattn: error: {exc}", file=sys.stderr)
        return 2
    if not os.environ.get("RAY_ADDRESS"):
        local_cluster_env()  # before Ray starts: its processes read it
        # Logical CPUs for the ingress replicas, and per engine replica one for it and one per worker, however few cores.
        needed = args.ingress_replicas + args.num_replicas * (1 + args.tp * args.pp)
        ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    # SIGTERM (a process manager, a container stopping) stops it as Ctrl-C does, from here on (Ray's own handler, set
    # when it connected, just exits): Serve's shutdown is what stops HAProxy, which outlives a killed Ray.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve.run(app, route_prefix="/")
        for line in _kv_capacity_lines():
            print(line, flush=True)
        name = args.served_model_name or Path(args.model).name or args.model
        auth = ' -H "Authorization: Bearer $KEY"' if serve_args.settings().api_keys else ""  # the key itself stays unprinted
        print(f"\nvattn serves {name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C stops it). Try:\n"
              f"  curl http://{args.host}:{args.port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
              f"""-d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'\n""",
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    except Exception as exc:
        print(f"vattn: error: the app did not start: {exc}{_deployment_errors()}", file=sys.stderr)
        serve.shutdown()
        return 1
    return 0


def _deployment_errors() -> str:
    """Why Serve's deployments failed, as their replicas raised it (the last line of each one's message: the error
    a replica's start raised, e.g. a KV pool larger than the memory free); "" where Serve says nothing more."""
    from ray import serve

    try:
        applications = serve.status().applications.values()
    except Exception:  # Serve itself is down: the error above is all there is
        return ""
    lines = [f"\n  {name}: {d.message.strip().splitlines()[-1]}" for a in applications
             for name, d in a.deployments.items() if d.message.strip()]
    return "".join(lines)


def _kv_capacity_lines() -> list[str]:
    """What each engine replica's KV pool holds, as vLLM says it at start (its "GPU KV cache size: N tokens"):
    the size a user chose -- or, with no memory option, the share of what the weights left -- in tokens."""
    import ray

    from server.engine import scheduler_actors

    actors = sorted(scheduler_actors().items())
    lines = []
    for replica, actor in actors:
        snap, (max_model_len, _) = ray.get([actor.snapshot.remote(), actor.ready.remote()])
        w = min(snap.workers, key=lambda w: w.total_pages)
        where = f" (replica {replica})" if len(actors) > 1 else ""
        lines.append(f"KV cache{where}: {w.total_pages:,} pages, {w.pool_bytes / 2**30:.2f} GiB a worker, holds "
                     f"{snap.kv_capacity_tokens:,} tokens -- {snap.kv_capacity_tokens / max_model_len:.1f} requests of "
                     f"the full {max_model_len:,}-token context at once")
    return lines


if __name__ == "__main__":
    sys.exit(main())
