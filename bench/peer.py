"""vattn against vLLM on the same GPU: the same prompts through both engines' offline APIs, alternating, in one call.

Each engine runs in its own process (vLLM's with ``PYTHONPATH=<vllm site>``, see ``peer_vllm.py``), one process per
model shape, every workload of that shape ``--reps`` times after the same warm-up. The processes run in the
order the sides are listed and then in reverse (ABBA; with two vLLM settings, ABCCBA), so drift of the machine
lands on both. vLLM runs twice: with its defaults and with our batch settings (the same
``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len`` and KV bytes); the better of the two is the
peer. The floor is measured in the same call. Results of another call, or of other prompts, are refused.

    python bench/peer.py run --vllm-site /tmp/vroot/site [--workloads w1 decode long] [--profile w1]
    python bench/peer.py run --workloads prefix chat --sides vattn vattn-nocache vllm vllm-defaults
    python bench/peer.py run --tp 2 --workloads w1 decode       # both engines over two GPUs (vattn's on Ray)
    python bench/peer.py compare RESULT.json ...      # the check and the table, on saved side results

Every timed run starts from an empty prefix cache in both engines; ``prefix`` and ``chat`` share prefixes within
the run (``vattn-nocache``: vattn with prefix caching off, for the gain; ``vattn-zero``: the zero page over 256 tokens
past each slot's pages, for what it costs; ``vattn-noguard``: the zero page over all unmapped KV space, not only 256 tokens past each slot's pages;
``vattn-page8m``, ``vattn-page4m``: 8 or 4 MiB pages; ``vattn-fused``: cached prefixes of 16 pages or more fused into one allocation on their first reuse; ``vattn-fa2decode``: all-decode steps on flash-attn's kernel, not FA3's decode tiles; ``vattn-tilesall``: FA3's decode tiles at every batch size; ``vattn-noprefixahead``: cached prefixes mapped at admission only; ``vattn-mapfirst``: the next step's pages mapped while a step's kernels are queued (the order before 2026-11-29), not after;
``vattn-tp1``: one GPU beside ``--tp N``'s sides; ``vattn-pp2`` (a token ring by default), ``vattn-pp2-p2p``,
``vattn-pp2-channel``: with ``--tp 2``, the two GPUs as pipeline stages; ``vattn-nccl``: with ``--tp N``, every sum on NCCL, none through
peer memory; ``vattn-depth2``: two steps in flight through Ray, ``async_depth=2``, not three; ``vattn-oneshot``: with
``--tp N``, the small sums through torch's one-shot kernel, ``VATTN_PEER_ALL_REDUCE=one_shot``, not our Lamport kernel;
``vattn-oneshot-depth2``: both, the defaults before the eighth 2xH200 run; ``vattn-wholehead``: with ``--tp N``, the
LM head whole on every rank, ``VATTN_SPLIT_LM_HEAD=0``, not split by vocabulary).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

import report
from cluster.engine import LLM
from peer_spec import (PeerMismatch, SideResult, SideSpec, WorkloadRun, check_comparable, digest,
                       steady_running)
from worker.heap import freeze_heap
from worker.model import splits_lm_head
from worker.peer_all_reduce import default_kernel
from worker.sampling import SamplingParams

GiB = 1 << 30
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Workload:
    """``requests`` prompts of random token ids, lengths uniform in [lo, hi], ``output`` tokens each (greedy,
    EOS ignored), all submitted at once."""

    model: str  # a preset
    requests: int
    lo: int
    hi: int
    output: int
    about: str
    kv_memory_gib: float | None = None  # both engines' KV bytes (default: --kv-memory-gib)
    stepwise: bool = False  # count the requests running in each step (WorkloadRun.stepwise)
    # Shared prefixes: request i starts with prefix i % prefixes (prefix_lo..prefix_hi tokens), then its own lo..hi.
    prefixes: int = 0
    prefix_lo: int = 0
    prefix_hi: int = 0
    # Conversations: each later turn sends the last prompt, the engine's answer and a new message of lo..hi tokens.
    turns: int = 1

    @property
    def max_len(self) -> int:
        return self.prefix_hi + self.hi + (self.turns - 1) * (self.hi + self.output) + self.output

    @property
    def has_floor(self) -> bool:
        """The roofline floor computes every prompt token: no floor where prefixes are shared."""
        return not self.prefixes and self.turns == 1

    def shared_prefixes(self, config, seed: int) -> list[list[int]]:
        """The prefixes request i % prefixes starts with."""
        from throughput import random_prompts

        return random_prompts(config, self.prefixes, self.prefix_lo, self.prefix_hi, seed + 1)

    def prompts(self, config, seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
        """(first prompts, later turns' messages), random token ids as ``throughput.random_prompts`` draws them."""
        from throughput import random_prompts

        if not self.prefixes and self.turns == 1:
            return random_prompts(config, self.requests, self.lo, self.hi, seed), []
        shared = self.shared_prefixes(config, seed)
        own = random_prompts(config, self.requests * self.turns, self.lo, self.hi, seed)
        firsts = [shared[i % self.prefixes] + own[i] for i in range(self.requests)] if self.prefixes else own[: self.requests]
        later = [own[self.requests * t : self.requests * (t + 1)] for t in range(1, self.turns)]
        return firsts, later


# vattn's sides: its defaults, and the modes measured against them.
VATTN_SIDES = {
    "vattn": {},
    "vattn-nocache": {"enable_prefix_caching": False},  # what prefix caching gains
    "vattn-zero": {"zero_unmapped": True},  # the zero page over 256 tokens past each slot's pages: what it costs
    "vattn-noguard": {"zero_unmapped": True, "kv_guard_tokens": None},  # the zero page over all unmapped KV space
    "vattn-page8m": {"page_size": 8 << 20},  # a quarter of the driver calls a token, at 4x coarser prefix granularity
    "vattn-page4m": {"page_size": 4 << 20},  # half the driver calls a token (they go by allocation), at 2x coarser
    "vattn-fused": {"fused_prefix_pages": 16},  # a cached prefix reused elsewhere made one allocation: one call a map
    "vattn-fa3": {"attention": "fa3"},  # FlashAttention-3, one kernel a step (tools/build_fa3.py), as vLLM runs
    "vattn-fa2decode": {},  # all-decode steps on flash-attn's kernel, not FA3's decode tiles (environment below)
    "vattn-tilesall": {},  # FA3's decode tiles at every batch size, not flash-attn's kernel past 256 sequences
    "vattn-noprefixahead": {},  # cached prefixes mapped at admission only, not ahead of it (environment below)
    "vattn-mapfirst": {},  # the next step's pages mapped while a step's kernels are queued, not after (environment)
    # One GPU, through Ray as the TP sides run, beside ``--tp N``'s: what N GPUs gain, in the call that measures vLLM
    "vattn-tp1": {"tensor_parallel_size": 1},
    # The same GPUs as pipeline stages, each a micro-batch in flight: the default (a token ring), the stages' own
    # hand-off without the ring, and the compiled graph's channel
    "vattn-pp2": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
    "vattn-pp2-p2p": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "pipeline_handoff": "p2p"},
    "vattn-pp2-channel": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "pipeline_handoff": "channel"},
    # With ``--tp N``: every sum on NCCL, not the small ones through peer memory (worker/peer_all_reduce.py)
    "vattn-nccl": {"disable_custom_all_reduce": True},
    # The defaults before the eighth 2xH200 run (docs/performance.md): two steps in flight through Ray, not three;
    # with ``--tp N``, TP's small sums through torch's one-shot kernel, not our Lamport kernel (environment below)
    "vattn-depth2": {"async_depth": 2},
    "vattn-oneshot": {},
    "vattn-oneshot-depth2": {"async_depth": 2},  # both
    "vattn-wholehead": {},  # with ``--tp N``: the LM head whole on every rank, not split by vocabulary (environment)
}
VATTN_SIDE_ENV = {"vattn-fa2decode": {"VATTN_FA3_DECODE_TILES": "0"},
                  "vattn-noprefixahead": {"VATTN_PREFIX_AHEAD_TOKENS": "0"},
                  "vattn-mapfirst": {"VATTN_MAP_DURING_LAUNCH": "1"},
                  "vattn-tilesall": {"VATTN_FA3_DECODE_TILES_MAX_BATCH": str(1 << 30)},
                  "vattn-oneshot": {"VATTN_PEER_ALL_REDUCE": "one_shot"},
                  "vattn-oneshot-depth2": {"VATTN_PEER_ALL_REDUCE": "one_shot"},
                  "vattn-wholehead": {"VATTN_SPLIT_LM_HEAD": "0"}}

WORKLOADS = {
    "w1": Workload("llama-3-8b", 128, 512, 2048, 128, "W1: 128 prompts of 512-2048 tokens, 128 out"),
    "decode": Workload("llama-3-8b", 256, 256, 256, 1024, "decode-heavy: 256 prompts of 256 tokens, 1024 out"),
    "long": Workload("qwen2.5-7b", 16, 8192, 32000, 128, "long context: 16 prompts of 8K-32K tokens, 128 out"),
    # KV memory is the limit: 256 W1-like requests against 8 GiB of KV (65,536 tokens in either engine), so how
    # many run at once is decided by how each engine spends its KV bytes.
    "memory": Workload("llama-3-8b", 256, 512, 2048, 128, "memory-bound: 256 prompts of 512-2048 tokens, 128 out, "
                       "8 GiB of KV", kv_memory_gib=8, stepwise=True),
    "prefix": Workload("llama-3-8b", 512, 256, 256, 128, "shared prefixes: 32 system prompts of 2-4K tokens, 16 "
                       "questions of 256 tokens on each, 128 out", prefixes=32, prefix_lo=2048, prefix_hi=4096),
    "chat": Workload("llama-3-8b", 64, 128, 256, 128, "multi-turn chat: 64 conversations of 6 turns, one 1K-token "
                     "system prompt, messages of 128-256 tokens, 128 out a turn", prefixes=1, prefix_lo=1024,
                     prefix_hi=1024, turns=6),
}


def hf_config(preset: str) -> dict:
    """A Hugging Face ``config.json`` of the preset's shape, for vLLM's dummy weights."""
    from worker.config import PRESETS

    c = PRESETS[preset]
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[c.model_type]
    config = {
        "architectures": [arch], "model_type": c.model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }
    if c.model_type == "qwen2":
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_layers}
    else:
        config["attention_bias"] = c.qkv_bias
    return config


# -- the vattn side ---------------------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def vattn_generate(llm: LLM, prompts: list[list[int]], max_tokens: int,
                   followups: list[list[list[int]]] = ()) -> tuple[float, int]:
    """Wall seconds and output tokens of one ``generate`` over ``prompts`` from an empty prefix cache, and of one
    more per later turn (each prompt with its answer and the turn's message)."""
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    tokens = report.generated_tokens(outputs, max_tokens)
    for messages in followups:
        prompts = [p + list(o.outputs[0].token_ids) + m for p, o, m in zip(prompts, outputs, messages, strict=True)]
        outputs = llm.generate(prompts, params)
        tokens += report.generated_tokens(outputs, max_tokens)
    return time.perf_counter() - start, tokens


def vattn_stepwise(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[int]]:
    """As ``vattn_generate``, one engine step at a time, also counting the requests that gained a token each step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.reset_prefix_cache()
    _sync()
    start = time.perf_counter()
    for p in prompts:
        llm.add_request(p, params)
    counts, lengths = [], {}
    while llm.core.has_work:
        gained = 0
        for o in llm.step():
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            n = len(o.outputs[0].token_ids)
            gained += n > lengths.get(o.request_id, 0)
            lengths[o.request_id] = n
        counts.append(gained)
    return time.perf_counter() - start, sum(lengths.values()), counts


def vattn_round(llm: LLM, result: SideResult, run: WorkloadRun, prompts: list[list[int]], round_: int) -> None:
    """One timed run of a workload, recorded with the engine's stall, steps, preemptions and prefix cache hit
    rate (prompt tokens found cached / prompt tokens looked up) in it."""
    before = llm.snapshot()
    extra, followups = {}, run.followups()
    if run.stepwise:
        wall, tokens, extra["running"] = vattn_stepwise(llm, prompts, run.output)
    else:
        wall, tokens = vattn_generate(llm, prompts, run.output, followups)
    after = llm.snapshot()
    stall = after.workers[0].stall_seconds - before.workers[0].stall_seconds
    device = after.workers[0].device_seconds - before.workers[0].device_seconds
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    result.record(run.name, prompts, run.output, round_, wall, tokens, followups, stall_s=stall, device_s=device,
                  steps=after.num_steps - before.num_steps,
                  preemptions=after.num_preemptions - before.num_preemptions,
                  prefix_hit_rate=(after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else None,
                  **extra)
    print(f"{result.label} {run.name} round {round_}: {wall:.3f} s (stall {stall:.3f} s, device idle "
          f"{wall - device:.3f} s)", flush=True)


def vattn_profile(llm: LLM, spec: SideSpec, prompts: list[list[int]]) -> list[str]:
    """One run of ``prompts`` for ``spec.profile_tokens`` tokens under torch's profiler, in every worker (Ray's
    too: ``LLM.start_profile``); the traces' paths, in rank order."""
    llm.start_profile(Path(spec.profile_dir) / f"vattn_{spec.profile}")
    try:
        vattn_generate(llm, prompts, spec.profile_tokens)
    except BaseException:
        with contextlib.suppress(Exception):  # the run's own error is the one to see
            llm.stop_profile()
        raise
    return llm.stop_profile()


def run_vattn(spec: SideSpec, out: Path) -> None:
    """One vattn engine process: the ``SideSpec``'s warm-up, rounds and profile (in-process engine; with TP the
    Ray engine, its workers in processes of their own)."""
    start = time.perf_counter()
    llm = LLM(spec.model, **spec.engine_args)
    started = time.perf_counter() - start
    resolved = {k: v for k, v in vars(llm.plan.config).items() if k != "model"}
    env = report.environment()
    result = SideResult(
        call_id=spec.call_id, engine="vattn", label=spec.label, device=env["device"], versions=env["versions"],
        engine_args={"asked": spec.engine_args, "resolved": resolved | {
            "attention": llm.plan.attention, "async_depth": llm.plan.async_depth,
            "pipeline_handoff": llm.plan.pipeline_handoff,
            "peer_all_reduce": default_kernel(), "split_lm_head": splits_lm_head()}},
        start_s=started,
    )
    with llm:
        workloads = [(w, w.prompts()) for w in spec.workloads]
        warm = workloads[0][1][: spec.warmup_prompts]
        vattn_generate(llm, [p[: spec.warmup_tokens] for p in warm], 8)
        # This process is the engine's, as vLLM's engine core process is its: its start-up heap out of the garbage
        # collector's sight, as vLLM's is once warm (worker/heap.py; the Ray processes do it themselves)
        freeze_heap("vattn side")
        for round_ in range(spec.reps):
            for run, prompts in workloads:
                vattn_round(llm, result, run, prompts, round_)
        if spec.profile:
            result.profile_traces = vattn_profile(llm, spec, dict((w.name, p) for w, p in workloads)[spec.profile])
            result.profile_trace = result.profile_traces[0]
    result.write(out)


# -- the orchestrator -------------------------------------------------------------------------------------------
def prepare(args, call_id: str, work: Path) -> dict[str, list[SideSpec]]:
    """Prompts and model directories on disk; the side specs of each model shape, in the order they run."""
    from worker.config import PRESETS

    groups: dict[tuple[str, float], list[str]] = {}  # one engine process per model and KV budget
    for name in args.workloads:
        w = WORKLOADS[name]
        groups.setdefault((w.model, w.kv_memory_gib or args.kv_memory_gib), []).append(name)
    specs: dict[str, list[SideSpec]] = {}
    for (preset, kv_gib), names in groups.items():
        runs = []
        for name in names:
            w = WORKLOADS[name]
            prompts, followups = w.prompts(PRESETS[preset], args.seed)
            path, later = work / f"prompts_{name}.json", work / f"followups_{name}.json"
            path.write_text(json.dumps(prompts))
            later.write_text(json.dumps(followups))
            runs.append(WorkloadRun(name, str(path), w.output, w.stepwise, str(later) if followups else None))
        model_dir = work / f"model_{preset}"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(hf_config(preset), indent=1))
        ours = {
            "max_num_seqs": max(WORKLOADS[n].requests for n in names),
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": max(WORKLOADS[n].max_len for n in names),
        }
        # A shape both engines take, vLLM's defaults too: its TP ranks are processes of its own (no Ray), ours Ray actors
        shape = {"tensor_parallel_size": args.tp} if args.tp > 1 else {}
        ours |= shape
        kv = int(kv_gib * GiB)
        budgeted = any(WORKLOADS[n].kv_memory_gib for n in names)
        profile = args.profile if args.profile in names else None
        common = dict(call_id=call_id, workloads=runs, reps=args.reps, profile_tokens=args.profile_tokens)
        sides = {name: SideSpec(engine="vattn", label=name, model=preset, **common, engine_args=ours | {
            "kv_memory": kv, "device": "cuda", "dtype": "bfloat16"} | ({"distributed": "ray"} if shape else {}) | extra)
            for name, extra in VATTN_SIDES.items()}
        sides |= {
            "vllm": SideSpec(engine="vllm", label="vllm", model=str(model_dir),
                             engine_args=ours | {"kv_cache_memory_bytes": kv}, **common),
            # its defaults, but for the KV bytes where they are what the workload compares
            "vllm-defaults": SideSpec(engine="vllm", label="vllm-defaults", model=str(model_dir), **common,
                                      engine_args=({"kv_cache_memory_bytes": kv} if budgeted else {}) | shape),
        }
        order = [] if args.profile_only else [sides[s] for s in args.sides] + [sides[s] for s in reversed(args.sides)]
        if profile:  # one more process per engine, after the timed ones: profiling slows the host
            order += [SideSpec(**{**vars(sides[s]), "reps": 0, "profile": profile,
                                  "profile_dir": str(work / "profiles" / s), "label": f"{s}-profile"})
                      for s in args.sides if s != "vllm-defaults"]
        specs[f"{preset} {kv_gib:g} GiB"] = order
    return specs


def launch(spec: SideSpec, work: Path, index: int, vllm_site: str, timeout: float) -> SideResult | None:
    """Run one side in its own process; its result, or None (the failure is printed and the others go on)."""
    spec_path, out = work / f"spec_{index}_{spec.label}.json", work / f"result_{index}_{spec.label}.json"
    spec.write(spec_path)
    env = dict(os.environ)
    if spec.engine == "vllm":  # vLLM's own environment only: its site shadows packages, and it has its FlashInfer
        script = HERE / "peer_vllm.py"
        env = {k: v for k, v in env.items() if not k.startswith("FLASHINFER_")}
        env["PYTHONPATH"] = os.pathsep.join([vllm_site, str(HERE)])
    else:
        script = Path(__file__)
        env |= VATTN_SIDE_ENV.get(spec.label, {})
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), *env.get("PYTHONPATH", "").split(os.pathsep)])
    cmd = [sys.executable, str(script)] + (["side"] if spec.engine == "vattn" else []) + [str(spec_path), str(out)]
    print(f"--- [{index}] {spec.label} ({spec.model})", flush=True)
    start = time.perf_counter()
    # A session of its own, killed whole afterwards: vLLM's engine core and TP workers are the side's children, and
    # a side that failed or timed out left them holding both GPUs' memory, so every later vLLM side failed to start
    # (2xH200, 2026-11-27).
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
        failure = f"exit status {rc}" if rc else None
    except subprocess.TimeoutExpired:
        failure = f"timed out after {timeout:g} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if failure:
        print(f"--- [{index}] {spec.label} FAILED: {failure}", flush=True)
        return None
    print(f"--- [{index}] {spec.label} took {time.perf_counter() - start:.0f} s", flush=True)
    return SideResult.read(out)


def floors(args, work: Path) -> dict:
    """Ceilings and each workload's floor, measured in a process of their own (no engine holds the GPU)."""
    out = work / "floor.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    subprocess.run([sys.executable, __file__, "floor", str(out), "--seed", str(args.seed), *args.workloads],
                   env=env, check=True)
    return json.loads(out.read_text())


def measure_floor(out: Path, names: list[str], seed: int) -> None:
    from throughput import ceilings, floor_seconds
    from worker.config import PRESETS

    ceil = ceilings()
    result = {"ceilings": ceil, "floors": {}}
    for name in names:
        w = WORKLOADS[name]
        if not w.has_floor:
            continue
        prompts, _ = w.prompts(PRESETS[w.model], seed)  # the runs' own prompts, drawn the one way
        result["floors"][name] = floor_seconds(PRESETS[w.model], prompts, w.output, ceil) | {
            "digest": digest(prompts, w.output)}
    out.write_text(json.dumps(result))


def compare(results: list[SideResult], floor: dict | None) -> tuple[list[str], list[list], dict]:
    """The table and the ratios: per workload, each side's mean wall over all its rounds and processes, the
    better vLLM setting as the peer, vattn / peer, and each against the floor."""
    check_comparable(results)
    walls: dict[tuple[str, str], list[float]] = {}
    hits: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if r.label.endswith("-profile"):
            continue
        for run in r.runs:
            walls.setdefault((run["workload"], r.label), []).append(run["wall_s"])
            if run.get("prefix_hit_rate") is not None:
                hits.setdefault((run["workload"], r.label), []).append(run["prefix_hit_rate"])
    labels = [lab for lab in dict.fromkeys(r.label for r in results) if not lab.endswith("-profile")]
    headers = ["workload"] + [f"{lab} s" for lab in labels] + ["vattn / best vLLM", "floor s", "vattn x floor",
                                                                "vLLM x floor"]
    rows, ratios = [], {}
    for name in dict.fromkeys(run["workload"] for r in results for run in r.runs):
        means = {lab: statistics.mean(walls[(name, lab)]) for lab in labels if (name, lab) in walls}
        peers = {lab: t for lab, t in means.items() if lab.startswith("vllm")}
        f = floor["floors"].get(name) if floor else None
        if f and f["digest"] != next(r.digests[name] for r in results if name in r.digests):
            raise PeerMismatch(f"workload {name}: the floor was measured on other prompts")
        best = min(peers.values()) if peers else None
        ratio = means["vattn"] / best if best and "vattn" in means else None
        ratios[name] = {"vattn_over_vllm": ratio, "means_s": means, "walls_s": {lab: walls[(name, lab)] for lab in means},
                        "prefix_hit_rate": {lab: statistics.mean(hits[(name, lab)]) for lab in means if (name, lab) in hits},
                        "best_vllm": min(peers, key=peers.get) if peers else None}
        if best:  # every vattn side's, for the modes measured against the defaults
            ratios[name]["over_best_vllm"] = {lab: t / best for lab, t in means.items() if lab.startswith("vattn")}
        if "vattn-tp1" in means:  # what --tp N GPUs gain over one, as TP or as PP stages (issue 26's targets)
            ratios[name]["over_vattn_tp1"] = {lab: t / means["vattn-tp1"] for lab, t in means.items()
                                              if lab.startswith("vattn") and lab != "vattn-tp1"}
        fl = f["total_s"] if f else None
        rows.append([name] + [means.get(lab) for lab in labels] + [
            ratio, fl, means["vattn"] / fl if fl and "vattn" in means else None, best / fl if fl and best else None])
    return headers, rows, ratios


def concurrency(results: list[SideResult]) -> dict:
    """For stepwise workloads, per side: the most requests that gained a token in one step, and the median over
    the middle half of the steps (ramp-up and drain left out), mean over the side's rounds; and vattn's over the
    better vLLM setting's."""
    out: dict[str, dict] = {}
    for r in results:
        for run in r.runs:
            counts = run.get("running")
            if not counts:
                continue
            side = out.setdefault(run["workload"], {}).setdefault(r.label, {"peak": [], "steady": [], "preemptions": []})
            side["peak"].append(max(counts))
            side["steady"].append(steady_running(counts))
            if "preemptions" in run:
                side["preemptions"].append(run["preemptions"])
    for sides in out.values():
        for label, side in sides.items():
            sides[label] = {k: statistics.mean(v) if v else None for k, v in side.items()} | {"raw": side}
        peers = [v for k, v in sides.items() if k.startswith("vllm")]
        if peers and "vattn" in sides:
            sides["vattn_over_vllm"] = {k: sides["vattn"][k] / max(p[k] for p in peers) for k in ("peak", "steady")}
    return out


def breakdowns(results: list[SideResult], requests: int) -> dict:
    """Per profiled engine and rank: the mean prefill step (>= 4096 prefill tokens) and full decode step by
    category; for a rank after the first, how much later than rank 0 its decode steps' first kernels start (the
    median over the steps both ran; the traces share the host's clock), which a rank that launches late shows."""
    import re

    import trace_breakdown as tb

    def kind(name: str) -> str | None:
        m = re.search(r"prefill\((\d+)\)_decode\((\d+)\)", name) or re.search(
            r"context_\d+\((\d+)\)_generation_\d+\((\d+)\)", name)
        if not m:
            return None
        prefill, decode = map(int, m.groups())
        return "prefill" if prefill >= 4096 else "decode" if prefill == 0 and decode == requests else None

    out = {}
    for r in results:
        first: list[float | None] = []
        for rank, trace in enumerate(r.profile_traces or [t for t in [r.profile_trace] if t]):
            found = tb.steps(tb.load(Path(trace)), r"^(execute_context_|vattn_step_)")
            label = r.label if rank == 0 else f"{r.label} rank {rank}"
            out[label] = {k: tb.summarize([s for s in found if kind(s.name) == k]) for k in ("prefill", "decode")}
            starts = [s.first_kernel_us for s in found if kind(s.name) == "decode"]
            if rank == 0:
                first = starts
            elif lags := [b - a for a, b in zip(first, starts) if a is not None and b is not None]:
                out[label]["decode_start_after_rank0_ms"] = statistics.median(lags) / 1e3
    return out


def describe(steps: dict) -> list[str]:
    """A line per engine, rank and kind of step of ``breakdowns``' result."""
    lines = []
    for label, kinds in steps.items():
        for kind in ("prefill", "decode"):
            if (b := kinds[kind]).get("steps"):
                cats = "  ".join(f"{k} {v:.2f}" for k, v in b["by_category_ms"].items())
                lag = kinds.get("decode_start_after_rank0_ms") if kind == "decode" else None
                maps = b.get("map_ahead_ms", 0) + b.get("map_wait_ms", 0)
                lines.append(f"{label} {kind} step ({b['steps']}): kernels {b['kernel_ms']:.2f} ms, device span "
                             f"{b['device_span_ms'] or 0:.2f} ms, host {b['host_ms']:.2f} ms"
                             + (f" (mapping beside it {b['map_ahead_ms']:.2f} ms, waited for {b['map_wait_ms']:.2f} ms)"
                                if maps else "")
                             + (f", starting {lag:.2f} ms after rank 0's" if lag is not None else "") + f": {cats}"
                             + ("; host: " + "  ".join(f"{k} {v:.2f}" for k, v in b["phases_ms"].items())
                                if b.get("phases_ms") else ""))
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="both engines on the workloads, alternating, in this call")
    run.add_argument("--workloads", nargs="+", default=["w1"], choices=sorted(WORKLOADS))
    run.add_argument("--sides", nargs="+", default=["vattn", "vllm", "vllm-defaults"],
                     choices=[*VATTN_SIDES, "vllm", "vllm-defaults"])
    run.add_argument("--vllm-site", default="/tmp/vroot/site", help="vLLM's install (the bundle's PYTHONPATH)")
    run.add_argument("--reps", type=int, default=2, help="timed rounds per process")
    run.add_argument("--tp", type=int, default=1, help="tensor parallel size of both engines (vattn's through Ray)")
    run.add_argument("--max-num-batched-tokens", type=int, default=8192)
    run.add_argument("--kv-memory-gib", type=float, default=40)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--profile", choices=sorted(WORKLOADS), help="profile this workload in both engines, after")
    run.add_argument("--profile-tokens", type=int, default=32)
    run.add_argument("--profile-only", action="store_true", help="only the profiled processes, no timed rounds")
    run.add_argument("--timeout", type=float, default=900, help="seconds per engine process")
    run.add_argument("--work", type=Path, default=Path("/tmp/vattn_peer"))
    run.add_argument("--name", default="peer")
    run.add_argument("--out", type=Path, default=report.RESULTS)
    cmp_ = sub.add_parser("compare", help="check and tabulate saved side results")
    cmp_.add_argument("results", nargs="+", type=Path)
    side = sub.add_parser("side", help="(internal) one vattn engine process")
    side.add_argument("spec", type=Path)
    side.add_argument("result", type=Path)
    fl = sub.add_parser("floor", help="(internal) ceilings and floors")
    fl.add_argument("out", type=Path)
    fl.add_argument("--seed", type=int, default=0)
    fl.add_argument("workloads", nargs="+")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.cmd == "side":
        return run_vattn(SideSpec.read(args.spec), args.result)
    if args.cmd == "floor":
        return measure_floor(args.out, args.workloads, args.seed)
    if args.cmd == "compare":
        headers, rows, _ = compare([SideResult.read(p) for p in args.results], None)
        return print(report.tabulate(rows, headers=headers, floatfmt=".3f"))
    if args.profile_only and args.profile not in args.workloads:
        raise SystemExit("--profile-only runs the profiled processes only: name one of --workloads with --profile")
    if args.tp > 1:
        stepwise = [n for n in args.workloads if WORKLOADS[n].stepwise]
        if stepwise:
            raise SystemExit(f"--tp {args.tp} runs vattn on Ray, whose steps this process cannot see: "
                             f"leave out {', '.join(stepwise)}")
        if args.tp > torch.cuda.device_count():
            raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
        # NVLink multicast stays off (the machines' rule), both sides. vLLM 0.26 would fuse its all-reduce and RMSNorm
        # through FlashInfer's "mnnvl" backend, which is multicast (on 2xH200 it met an illegal memory access, then
        # hung): "trtllm" is the same fusion over peer memory, vLLM's own choice where multicast is missing.
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                          VLLM_FLASHINFER_ALLREDUCE_BACKEND="trtllm")
    call_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    args.work.mkdir(parents=True, exist_ok=True)
    floor = floors(args, args.work) if args.tp == 1 and not args.profile_only else None  # one GPU's floor
    results, index = [], 0
    for preset, specs in prepare(args, call_id, args.work).items():
        for spec in specs:
            r = launch(spec, args.work, index, args.vllm_site, args.timeout)
            index += 1
            if r is not None:
                results.append(r)
    # profiled processes alone time nothing: only their breakdowns (one engine's, should the other fail)
    headers, rows, ratios = ([], [], {}) if args.profile_only else compare(results, floor)
    running = concurrency(results)
    for name, sides in running.items():
        print(f"{name}: requests running at once, peak / steady: " + ", ".join(
            f"{k} {v['peak']:.1f} / {v['steady']:.1f}" for k, v in sides.items()))
    steps = breakdowns(results, WORKLOADS[args.profile].requests) if args.profile else {}
    for line in describe(steps):
        print(line)
    data = {"call_id": call_id, "workloads": {n: vars(WORKLOADS[n]) for n in args.workloads}, "floor": floor,
            "ratios": ratios, "concurrency": running, "breakdown": steps, "sides": [vars(r) for r in results]}
    report.write(args.name, headers, rows, data, args.out)
    if rows:
        plot(rows, headers, args.out / f"{args.name}.png")


def plot(rows: list[list], headers: list[str], path: Path) -> None:
    """Bars per workload: each side's wall over the roofline floor where the workload has one, else over the best
    vLLM side's wall (shared prefixes: no floor computes every token), else seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [h[:-2] for h in headers[1:] if h.endswith(" s") and h != "floor s"]
    peers = [headers.index(f"{s} s") for s in sides if s.startswith("vllm")]
    floor_col = headers.index("floor s")

    def reference(row: list) -> tuple[float, str]:
        if row[floor_col]:
            return row[floor_col], "floor"
        best = min((row[c] for c in peers if row[c]), default=None)
        return (best, "best vLLM") if best else (1.0, "s")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / (len(sides) + 1)
    for i, side in enumerate(sides + ["floor"]):
        col = headers.index(f"{side} s")
        ys = [r[col] / reference(r)[0] if r[col] else 0 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], ys, width, label=side)
    ax.set_xticks([j + width * len(sides) / 2 for j in range(len(rows))],
                  [f"{r[0]}\n(/ {reference(r)[1]})" for r in rows])
    ax.set_ylabel("wall / reference (lower is better)")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
