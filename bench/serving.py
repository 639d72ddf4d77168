"""Serving benchmark over the HTTP API, in the spirit of vLLM's benchmark_serving: streaming completions at fixed
concurrency levels; time to first token, inter-token latency (between chunks, as a client sees them: a chunk may
carry several tokens), time per output token ((e2e - TTFT) / (tokens - 1), per request) and end-to-end latency
(p50/p90/p99), output tok/s.

    python bench/serving.py --model tiny --device cpu --concurrency 1 16 64 256         # starts the server itself
    python bench/serving.py --url http://127.0.0.1:8000 --served-name smollm2 ...       # or measures a running one
    python bench/serving.py --offline --model tiny --device cpu ...      # the same prompts offline (no server)

Prompts are random token ids (exact input lengths), greedy, EOS ignored, every request streams with usage;
``--text`` sends them as text and ``--temperature -1`` leaves the draw to the server's default, as vLLM's
``vllm bench serve`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import report  # noqa: E402
from worker.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402


@dataclass
class Sample:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str | None = None


#: The server's own latency histograms (vLLM's names; vattn's carry its prefix instead of ``vllm:``).
ENGINE_HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds", "e2e_request_latency_seconds",
                     "request_ingress_seconds", "first_token_pickup_seconds",  # the last three: the serving path's
                     "stream_outputs_per_poll")  # (its mean: the steps a stream's tokens reach its client in at once)


def engine_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of ``ENGINE_HISTOGRAMS`` in a Prometheus exposition, over all its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        name = family.name.rpartition(":")[2]
        if name not in ENGINE_HISTOGRAMS:
            continue
        total, count = totals.get(name, (0.0, 0.0))
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
        totals[name] = (total, count)
    return totals


def engine_means(before: dict, after: dict) -> dict[str, float | None]:
    """Mean seconds of each server histogram over the requests between two ``engine_totals``."""
    means = {}
    for name in ENGINE_HISTOGRAMS:
        (s0, c0), (s1, c1) = before.get(name, (0.0, 0.0)), after.get(name, (0.0, 0.0))
        means[name] = (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return means


async def one(client: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    s, start, last = Sample(), time.perf_counter(), None
    try:
        async with client.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                s.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return s
            async for raw in r.content:  # lines
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = chunk["error"]["message"]
                    return s
                now = time.perf_counter()
                if chunk.get("usage"):
                    s.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    if last is None:
                        s.ttft = now - start
                    else:
                        s.itl.append(now - last)
                    last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.e2e = time.perf_counter() - start
    return s


async def level(url: str, name: str, prompts: list, output: int, concurrency: int, key: str | None,
                rate: float | None = None, temperature: float | None = 0.0) -> dict:
    """``prompts`` (token ids or text) at most ``concurrency`` at a time, or arriving as a Poisson process of ``rate``
    requests/s; ``temperature`` None leaves it to the server's default (as ``vllm bench serve`` does)."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    sampling = {} if temperature is None else {"temperature": temperature}

    async def gated(client, prompt):
        async with gate:
            return await one(client, url, {"model": name, "prompt": prompt, "max_tokens": output, **sampling,
                                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})

    async def arriving(client):
        gaps, tasks = random.Random(len(prompts)), []
        for p in prompts:
            tasks.append(asyncio.create_task(gated(client, p)))
            await asyncio.sleep(gaps.expovariate(rate))
        return await asyncio.gather(*tasks)

    # aiohttp, as vLLM's benchmark client: httpx's async streams cost ~4x the CPU per event, and at 256 streams of
    # 30 tokens/s one client process ran out of core before the server did (both servers' TTFT grew seconds).
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                     headers=headers) as client:
        start, cpu = time.perf_counter(), time.process_time()
        if rate:
            samples = await arriving(client)
        else:
            samples = await asyncio.gather(*(gated(client, p) for p in prompts))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    ok = [s for s in samples if s.error is None]

    def pct(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p90": None, "p99": None, "mean": None}
        q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
        return {"p50": q[49], "p90": q[89], "p99": q[98], "mean": statistics.fmean(values)}

    tokens = sum(s.output_tokens for s in ok)
    return {
        "concurrency": concurrency, "rate": rate, "requests": len(prompts), "errors": len(samples) - len(ok),
        "first_errors": [s.error for s in samples if s.error][:3], "wall_s": wall,
        "output_tok_s": tokens / wall, "request_s": len(ok) / wall, "output_tokens": tokens,
        # the client's own CPU time over the wall: near 1, the client (one process) is what limits the level
        "client_cpu_share": cpu / wall,
        "ttft_s": pct([s.ttft for s in ok]), "itl_s": pct([x for s in ok for x in s.itl]), "e2e_s": pct([s.e2e for s in ok]),
        "tpot_s": pct([(s.e2e - s.ttft) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1]),
    }


def offline_level(llm, prompts: list[list[int]], output: int, concurrency: int) -> dict:
    """A closed-loop level's prompts through ``llm`` all at once (greedy, EOS ignored): the engine's own rate on the
    requests the level's clients send, ``concurrency`` kept only to name the level."""
    from worker.sampling import SamplingParams

    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=output, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - start
    tokens = report.generated_tokens(outputs, output)
    return {"concurrency": concurrency, "rate": None, "requests": len(prompts), "errors": 0, "wall_s": wall,
            "output_tok_s": tokens / wall, "request_s": len(prompts) / wall, "output_tokens": tokens, "offline": True}


def engine_options(args) -> dict:
    """The engine's options this run gives, as ``LLM`` and ``vattn serve``'s arguments both take them."""
    from cluster.config import parse_size

    options = {"kv_memory": parse_size(args.kv_memory), "max_num_seqs": args.max_num_seqs,
               "max_model_len": max_model_len(args), "max_num_batched_tokens": args.max_num_batched_tokens,
               "enable_prefix_caching": args.enable_prefix_caching}
    for key in ("mixed_graph_tokens", "device", "dtype", "load_format"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.page_size:
        options["page_size"] = parse_size(args.page_size)
    return options


def offline_engine(args):
    """``vattn serve``'s engine (the Ray engine, one replica) with this run's options, in this process."""
    from cluster.engine import LLM

    return LLM(args.model, distributed="ray", **engine_options(args))


def max_model_len(args) -> int:
    return args.max_model_len or args.prefix_len + args.input + args.output + 8


def start_server(args) -> tuple[str, str]:
    """A Serve app in this process (local Ray) with the engine options given; (url, served model name)."""
    import ray
    from ray import serve

    from server.app import app_builder
    from server.serve_env import free_local_port, local_cluster_env

    local_cluster_env()  # the data plane `vattn serve` uses
    ray.init(num_cpus=max(os.cpu_count() or 1, 2 + args.ingress_replicas), include_dashboard=False, log_to_driver=False)
    port = free_local_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve_args = {"model": args.model, **engine_options(args), "max_n": 1, "max_pending": 100_000,
                  "ingress_replicas": args.ingress_replicas}
    serve.run(app_builder(serve_args), route_prefix="/")
    return f"http://127.0.0.1:{port}", Path(args.model).name or args.model


def plot(levels: list[dict], path: Path, title: str) -> None:
    levels = [r for r in levels if not r["rate"]]  # the fixed-concurrency levels
    c = [r["concurrency"] for r in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "e2e")):
        a.plot(c, [1e3 * (r[key]["p50"] or 0) for r in levels], marker="o", label=f"{label} p50")
        a.plot(c, [1e3 * (r[key]["p99"] or 0) for r in levels], marker="x", ls="--", label=f"{label} p99")
    a.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency")
    a.legend(fontsize=7)
    b.plot(c, [r["output_tok_s"] for r in levels], marker="o")
    b.set(xscale="log", xlabel="concurrent clients", ylabel="output tok/s", title="throughput")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (else one is started here with the options below)")
    p.add_argument("--served-name", help="the model name the running server serves")
    p.add_argument("--api-key")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device")
    p.add_argument("--dtype", help="the engine's (default: its own)")
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--page-size")
    p.add_argument("--load-format", help="dummy: random weights for a model directory with only its config.json")
    p.add_argument("--ingress-replicas", type=int, default=1)
    p.add_argument("--mixed-graph-tokens", type=int, default=None,
                   help="the engine's (steps that prefill in CUDA graphs; default: the engine's)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, help="the server started here (default: the longest request + 8)")
    p.add_argument("--offline", action="store_true",
                   help="no server: each closed-loop level's prompts (the same ones, same seed) through vattn serve's "
                        "engine in this process (`LLM` on Ray, the options above), all at once -- our own offline rate "
                        "on what the clients send")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64, 256], help="none: --rates only")
    p.add_argument("--rates", type=float, nargs="*", default=[],
                   help="then Poisson arrivals at these requests/s (at most 1024 open at once), --rate-seconds of them each")
    p.add_argument("--rate-seconds", type=float, default=20)
    p.add_argument("--requests", type=int, default=0, help="per level (default: --rounds x the concurrency, at least 16)")
    p.add_argument("--rounds", type=int, default=4, help="requests per client at each level, unless --requests")
    p.add_argument("--input", type=int, default=128, help="prompt tokens")
    p.add_argument("--output", type=int, default=64, help="output tokens")
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    p.add_argument("--prefixes", type=int, default=0,
                   help="shared prefixes: each prompt starts with one of this many (drawn at random) of --prefix-len "
                        "tokens, then --input tokens of its own (vllm bench serve's prefix_repetition dataset)")
    p.add_argument("--prefix-len", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the server started here (default on, as vattn serve)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's; a negative value sends none, leaving the server's default (1 in both "
                        "servers: what `vllm bench serve` does)")
    p.add_argument("--text", action="store_true",
                   help="send each prompt as text, its ids decoded by --tokenizer (as `vllm bench serve`'s random "
                        "dataset does), not as token ids")
    p.add_argument("--tokenizer", help="for --text: a model directory or preset (default: --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-metrics", action="store_true",
                   help="also scrape the server's /metrics around each level: its own mean TTFT, queue time and e2e")
    p.add_argument("--name", default="serving")
    p.add_argument("--out", type=Path, default=report.RESULTS)
    args = p.parse_args()
    tokenizer = load_tokenizer(args.tokenizer or args.model) if args.text else None
    if isinstance(tokenizer, ByteTokenizer):
        # Random ids as bytes are mostly no UTF-8: the text sent is replacement characters, of another length, and
        # ids past 255 vanish (prompts came out empty at --vocab 32000).
        p.error(f"--text needs a model directory with a tokenizer.json (--tokenizer, or --model with --load-format "
                f"dummy); {args.tokenizer or args.model!r} has the byte tokenizer")
    if args.offline and (args.url or args.rates or args.text):
        p.error("--offline runs the closed-loop levels' token ids through the engine here: no --url, --rates, --text")
    rng = random.Random(args.seed)
    temperature = None if args.temperature < 0 else args.temperature
    as_sent = (lambda ids: ids) if tokenizer is None else tokenizer.decode
    warmup = [[rng.randrange(args.vocab) for _ in range(args.input)]] * 4
    loads = [(c, None, args.requests or max(16, args.rounds * c)) for c in args.concurrency]
    loads += [(1024, rate, max(16, round(rate * args.rate_seconds))) for rate in args.rates]
    shared = [[rng.randrange(args.vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    # Every level's prompts drawn before any runs: an offline run of the same seed gets the same ones.
    drawn = [[as_sent((rng.choice(shared) if shared else []) + [rng.randrange(args.vocab) for _ in range(args.input)])
              for _ in range(n)] for _, _, n in loads]
    if args.offline:
        with offline_engine(args) as llm:
            offline_level(llm, warmup, args.output, 4)
            levels = [offline_level(llm, prompts, args.output, c) for (c, _, _), prompts in zip(loads, drawn)]
        headers = ["clients (offline)", "requests", "wall s", "output tok/s", "req/s"]
        rows = [[r["concurrency"], r["requests"], r["wall_s"], r["output_tok_s"], r["request_s"]] for r in levels]
        report.write(args.name, headers, rows, {"model": args.model, "offline": True, "input_tokens": args.input,
                                                "output_tokens": args.output, "prefixes": args.prefixes,
                                                "prefix_len": args.prefix_len, "seed": args.seed, "levels": levels},
                     args.out)
        return
    url, name = (args.url, args.served_name) if args.url else start_server(args)
    levels = []
    asyncio.run(level(url, name, warmup, args.output, 4, args.api_key))

    def metrics() -> dict:
        return engine_totals(httpx.get(f"{url}/metrics", timeout=30).text)

    for (c, rate, n), prompts in zip(loads, drawn):
        before = metrics() if args.engine_metrics else None
        levels.append(asyncio.run(level(url, name, prompts, args.output, c, args.api_key, rate, temperature)))
        r = levels[-1]
        if before is not None:
            # What the engine saw against what the client saw: the difference is the serving path's.
            r["engine_mean_s"] = engine_means(before, metrics())
            print(f"  engine-side means: {json.dumps({k: v and round(v, 4) for k, v in r['engine_mean_s'].items()})}; "
                  f"client TTFT mean {r['ttft_s']['mean'] and round(r['ttft_s']['mean'], 4)} s, "
                  f"e2e mean {r['e2e_s']['mean'] and round(r['e2e_s']['mean'], 4)} s", file=sys.stderr)
        print(f"{f'{rate:g} req/s' if rate else f'{c} clients'}: {r['requests']} requests in {r['wall_s']:.1f} s, "
              f"{r['output_tok_s']:.0f} output tok/s, {r['errors']} errors", file=sys.stderr, flush=True)
    ms = lambda x: None if x is None else round(1e3 * x, 1)  # noqa: E731
    headers = ["clients / rate", "requests", "errors", "output tok/s", "req/s", "TTFT p50/p90/p99 ms", "TPOT p50/p99 ms",
               "ITL p50/p90/p99 ms", "e2e p50/p99 ms"]
    rows = [[f"{r['rate']:g}/s" if r["rate"] else r["concurrency"], r["requests"], r["errors"], round(r["output_tok_s"], 1), round(r["request_s"], 2),
             "/".join(str(ms(r["ttft_s"][k])) for k in ("p50", "p90", "p99")),
             "/".join(str(ms(r["tpot_s"][k])) for k in ("p50", "p99")),
             "/".join(str(ms(r["itl_s"][k])) for k in ("p50", "p90", "p99")),
             "/".join(str(ms(r["e2e_s"][k])) for k in ("p50", "p99"))] for r in levels]
    # A server at --url was started elsewhere, with front replicas this client does not know.
    data = {"model": name, "url": url if args.url else "started here",
            "ingress_replicas": None if args.url else args.ingress_replicas, "input_tokens": args.input,
            "output_tokens": args.output, "prefixes": args.prefixes, "prefix_len": args.prefix_len,
            "temperature": temperature, "text_prompts": args.text, "levels": levels}
    report.write(args.name, headers, rows, data, args.out)
    if args.concurrency:  # the figure is over concurrency
        plot(levels, args.out / f"{args.name}.png", f"{name}: {args.input} in / {args.output} out tokens, streaming")
    if any(r["errors"] for r in levels):
        sys.exit(f"errors: {[r['first_errors'] for r in levels if r['errors']]}")


if __name__ == "__main__":
    main()
