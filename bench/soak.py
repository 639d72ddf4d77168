"""A long run of mixed traffic against `vattn serve` (the real CLI, in a process of its own): does anything leak?

    python bench/soak.py --minutes 60 --clients 32          # starts `vattn serve --model tiny --device cpu` itself

Each client loops over a mix a deployment sees: short and long completions, chats, streams read to the end and
streams dropped after a few chunks, n=2 with logprobs, and bad requests (each must get its 4xx). Every
``--kill-every-s`` seconds the engine's worker actor is killed (SIGKILL to its process): the engine must rebuild its
workers and answer /health again within ``--recover-s``; the requests the dead worker was running end with the
engine's "the worker group failed" error (a 503, or an error event in a stream) and are counted apart. Every
``--sample-s`` seconds it records the resident memory of the server's whole process tree (the CLI, Ray's GCS and
raylet, the Serve controller, HAProxy, the ingress and engine replicas, the scheduler and worker actors) by process
kind, and the request and error counts. At the end the load stops, the server drains, and its /metrics must show
no request left, every KV slot free and no page holding tokens (pages free slots keep mapped for their next request
are reclaimable, and reported). A table, ``bench/results/<name>.json`` and a PNG of memory over time.
Unexpected errors: any other 5xx, any transport error on a request not dropped on purpose, a bad request not
refused, a killed worker not recovered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import matplotlib  # noqa: E402
import psutil  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import report  # noqa: E402
from server.serve_env import free_local_port  # noqa: E402

MODEL = "tiny"
MIX = {  # kind: weight
    "completion": 4, "long": 2, "chat": 3, "stream": 3, "dropped": 2, "n2_logprobs": 1, "bad": 1,
}
BAD = [  # (body changes, the status it must get)
    ({"max_tokens": -1}, 400), ({"temperature": -2}, 400), ({"model": "nope"}, 404), ({"n": 1000}, 400),
    ({"prompt": "x " * 5000}, 400), ({"logit_bias": {"999999999": 5}}, 400),
]
LOST = "the worker group failed"  # what the engine tells the requests a killed worker was running


def process_kind(p: psutil.Process) -> str:
    """A Ray process by what it runs (``ray::ServeReplica:vattn:VattnEngine`` -> ServeReplica:VattnEngine)."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "gone"
    head = cmd[0] if cmd else p.name()
    if head.startswith("ray::"):  # a running method shows in the title too: ray::SchedulerActor.wait_outputs
        name = head.removeprefix("ray::").split(".")[0]
        return "ServeReplica:" + name.rsplit(":", 1)[-1] if name.startswith("ServeReplica:") else name
    if "python" in Path(head).name:  # the CLI itself: python -m server.cli
        return "python " + next((Path(a).name for a in cmd[1:] if not a.startswith("-")), "")
    return Path(head).name


def tree_rss(root: psutil.Process) -> dict[str, int]:
    """Resident bytes of ``root`` and every process under it, summed by kind."""
    out: Counter = Counter()
    for p in [root, *root.children(recursive=True)]:
        try:
            out[process_kind(p)] += p.memory_info().rss
        except psutil.Error:
            continue
    return dict(out)


async def one(session: aiohttp.ClientSession, url: str, kind: str, rng: random.Random, stats: Counter,
              errors: list[str]) -> None:
    words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "while", "it", "rained"])
                     for _ in range(rng.randint(2, 60)))
    body: dict = {"model": MODEL, "prompt": words, "max_tokens": 16, "temperature": rng.choice([0, 0.8])}
    path, expect = "/v1/completions", 200
    if kind == "long":
        body |= {"max_tokens": 200, "ignore_eos": True}
    elif kind == "chat":
        path = "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 32}
    elif kind in ("stream", "dropped"):
        body |= {"stream": True, "max_tokens": 64, "ignore_eos": True}
    elif kind == "n2_logprobs":
        body |= {"n": 2, "logprobs": 2, "temperature": 1.0, "seed": rng.randrange(1 << 30)}
    elif kind == "bad":
        change, expect = rng.choice(BAD)
        body |= change
    try:
        async with session.post(url + path, json=body) as r:
            if kind == "dropped" and r.status == 200:
                chunks = 0
                async for _ in r.content:
                    chunks += 1
                    if chunks >= 3:
                        break  # the client goes away: leaving the context closes the connection
                stats["dropped"] += 1
                return
            text = await r.text()
            if LOST in text and (r.status == 503 or kind == "stream"):
                stats["lost_to_kill"] += 1
            elif r.status != expect:
                errors.append(f"{kind}: {r.status} (wanted {expect}): {text[:200]}")
            elif kind in ("stream",) and not text.rstrip().endswith("data: [DONE]"):
                errors.append(f"{kind}: stream ended without [DONE]: {text[-200:]}")
            stats[kind] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])


async def client(url: str, seed: int, stop: float, stats: Counter, errors: list[str]) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < stop:
            await one(session, url, rng.choices(kinds, weights)[0], rng, stats, errors)


async def sampler(root: psutil.Process, start: float, stop: float, every: float, stats: Counter, errors: list,
                  samples: list[dict]) -> None:
    while True:
        rss = tree_rss(root)
        samples.append({"t_s": time.monotonic() - start, "rss": rss, "total_rss": sum(rss.values()),
                        "requests": sum(stats.values()), "errors": len(errors)})
        s = samples[-1]
        print(f"[{s['t_s'] / 60:5.1f} min] rss {s['total_rss'] / 2**20:7.0f} MiB  requests {s['requests']:6d}  "
              f"errors {s['errors']}", flush=True)
        if time.monotonic() >= stop:
            return
        await asyncio.sleep(min(every, max(0.0, stop - time.monotonic())))


async def killer(root: psutil.Process, url: str, start: float, stop: float, every: float, recover: float,
                 kills: list[dict], errors: list[str]) -> None:
    """Every ``every`` seconds: SIGKILL the worker actor's process, then wait for /health to answer 200 again."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while (at := start + every * (len(kills) + 1)) < stop:
            await asyncio.sleep(at - time.monotonic())
            workers = [p for p in root.children(recursive=True) if process_kind(p) == "WorkerActor"]
            if not workers:
                errors.append("killer: no worker actor process to kill")
                return
            workers[0].kill()
            killed, recovered = time.monotonic(), None
            while recovered is None and time.monotonic() - killed < recover:
                await asyncio.sleep(0.5)
                try:
                    async with session.get(url + "/health") as r:
                        fresh = [p for p in root.children(recursive=True) if process_kind(p) == "WorkerActor"]
                        if r.status == 200 and fresh and fresh[0].pid != workers[0].pid:
                            recovered = time.monotonic() - killed
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
            kills.append({"t_s": killed - start, "pid": workers[0].pid, "recovered_s": recovered})
            print(f"[{(killed - start) / 60:5.1f} min] killed worker {workers[0].pid}: "
                  + (f"serving again after {recovered:.1f} s" if recovered is not None else "NOT recovered"), flush=True)
            if recovered is None:
                errors.append(f"killer: the engine did not recover within {recover} s of a worker's kill")


def start_server(port: int, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", MODEL, "--device", "cpu", "--host", "127.0.0.1",
           "--port", str(port), "--kv-memory", args.kv_memory, "--max-model-len", "512", "--max-num-seqs", "64"]
    log = open(args.log, "w")
    server = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vattn serve exited ({server.returncode}): see {args.log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vattn serve did not answer /health within 300 s: see {args.log}")


def drained(url: str, timeout: float = 60) -> dict[str, float]:
    """Wait for the server to hold no request; the gauges that say so, and the KV ones, summed over workers."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("num_requests_running", "num_requests_waiting", "kv_slots_in_use", "kv_mapped_bytes", "kv_used_bytes",
              "kv_prefix_cache_bytes", "kv_free_pages", "kv_total_pages")
    deadline = time.monotonic() + timeout
    while True:
        values = dict.fromkeys(wanted, 0.0)
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            name = family.name.rpartition(":")[2]
            if name in values:
                values[name] += sum(s.value for s in family.samples)
        if values["num_requests_running"] + values["num_requests_waiting"] + values["kv_slots_in_use"] == 0 \
                or time.monotonic() > deadline:
            return values
        time.sleep(1)


def plot(samples: list[dict], path: Path) -> None:
    kinds = sorted({k for s in samples for k in s["rss"]}, key=lambda k: -samples[-1]["rss"].get(k, 0))
    minutes = [s["t_s"] / 60 for s in samples]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(minutes, [[s["rss"].get(k, 0) / 2**20 for s in samples] for k in kinds], labels=kinds)
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident MiB (process tree)")
    ax.set_title("vattn serve --model tiny (CPU) under mixed traffic")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--kv-memory", default="64MiB")
    parser.add_argument("--log", default="/tmp/vattn_soak_server.log")
    parser.add_argument("--name", default="soak_cpu")
    parser.add_argument("--kill-every-s", type=float, default=300, help="kill the worker actor this often (0: never)")
    parser.add_argument("--recover-s", type=float, default=120, help="a killed worker's engine must serve again within")
    parser.add_argument("--out-dir", type=Path, default=report.RESULTS)
    args = parser.parse_args()
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args)
    stats, errors, samples, kills = Counter(), [], [], []
    try:
        start = time.monotonic()
        stop = start + args.minutes * 60

        async def run() -> None:
            root = psutil.Process(server.pid)
            chaos = [killer(root, url, start, stop, args.kill_every_s, args.recover_s, kills, errors)] if args.kill_every_s else []
            await asyncio.gather(sampler(root, start, stop, args.sample_s, stats, errors, samples), *chaos,
                                 *(client(url, seed, stop, stats, errors) for seed in range(args.clients)))

        asyncio.run(run())
        after = drained(url)
        samples.append({"t_s": time.monotonic() - start, "rss": tree_rss(psutil.Process(server.pid)),
                        "requests": sum(stats.values()), "errors": len(errors), "drained": True})
        samples[-1]["total_rss"] = sum(samples[-1]["rss"].values())
    finally:
        # SIGTERM to `vattn serve` alone: it stops Serve, HAProxy with it, then Ray. Its process group only after:
        # Ray killed first would leave HAProxy holding its ports.
        server.terminate()
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    marks = [m for m in (1, 10, 30) if m < args.minutes] + [args.minutes]
    # A sample taken while a killed worker is being replaced misses that worker's process: not a mark.
    steady = [s for s in samples[:-1] if not any(0 <= s["t_s"] - k["t_s"] <= (k["recovered_s"] or 0) + 30 for k in kills)]
    at = {m: min(steady or samples[:-1], key=lambda s: abs(s["t_s"] - 60 * m)) for m in marks}
    since = 10 if 10 in marks else marks[0]
    growth = (at[marks[-1]]["total_rss"] - at[since]["total_rss"]) / at[since]["total_rss"]
    rows = [[f"{m:g}", s["total_rss"] / 2**20, s["requests"], s["errors"]] for m, s in at.items()]
    rows.append(["after drain", samples[-1]["total_rss"] / 2**20, samples[-1]["requests"], len(errors)])
    out = report.write(args.name, ["minute", "resident MiB", "requests", "unexpected errors"], rows, {
        "minutes": args.minutes, "clients": args.clients, "mix": MIX, "requests_by_kind": dict(stats),
        "unexpected_errors": errors[:200], "unexpected_error_count": len(errors),
        "rss_growth_from_minute": {"minute": since, "growth": growth}, "after_drain": after, "samples": samples,
        "kills": kills, "lost_to_kills": stats["lost_to_kill"], "command": " ".join(sys.argv),
    }, args.out_dir)
    plot(samples, out.with_suffix(".png"))
    print(f"resident memory growth from minute {since} to the end: {100 * growth:+.1f}%; "
          f"unexpected errors: {len(errors)}; workers killed {len(kills)}, recovered "
          f"{sum(k['recovered_s'] is not None for k in kills)} (requests lost with them: {stats['lost_to_kill']}); "
          f"after drain: {json.dumps(after)}")


if __name__ == "__main__":
    main()
