"""The vLLM side of ``bench/peer.py``: one vLLM engine process runs a ``SideSpec`` and writes a ``SideResult``.

Runs in vLLM's own environment (``PYTHONPATH=/tmp/vroot/site``, ``../shared/tools/gpu_vllm_bundle.sh``); imports
vLLM and the standard library only, never the project. Offline ``LLM`` over a model directory holding only
``config.json``: dummy weights, token-id prompts, no tokenizer; greedy, EOS ignored. The prefix cache (on by
default) is reset before every timed run, so no run reuses an earlier run's prompts; within a run (shared prefixes,
a conversation's turns) it works as it would for any user.

    PYTHONPATH=/tmp/vroot/site python bench/peer_vllm.py SPEC.json RESULT.json
"""

from __future__ import annotations

import gc
import platform
import sys
import time
from pathlib import Path

import torch
import vllm
from vllm import LLM, SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.inputs import TokensPrompt

from peer_spec import SideResult, SideSpec


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int,
             followups: list[list[list[int]]] = ()) -> tuple[float, int, float]:
    """Wall seconds, output tokens and prefix cache hit rate (prompt tokens vLLM found cached / prompt tokens) of one
    ``generate`` over ``prompts`` from a cold prefix cache, and of one more per later turn (each prompt with its
    answer and the turn's message), as ``peer.vattn_generate`` runs them."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    asked, cached = sum(map(len, prompts)), sum(o.num_cached_tokens or 0 for o in outputs)
    for messages in followups:
        prompts = [p + list(o.outputs[0].token_ids) + m for p, o, m in zip(prompts, outputs, messages, strict=True)]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        asked, cached = asked + sum(map(len, prompts)), cached + sum(o.num_cached_tokens or 0 for o in outputs)
    return time.perf_counter() - start, tokens, cached / asked


def stepwise(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[int]]:
    """Wall seconds, output tokens and, per engine step, the requests that gained a token: the prompts run
    through the engine's own step loop (``LLM.generate`` runs the same loop), from a cold prefix cache."""
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
    counts, tokens = [], 0
    while engine.has_unfinished_requests():
        gained = [o for o in engine.step() if o.outputs and o.outputs[0].token_ids]
        counts.append(len(gained))
        tokens += sum(len(o.outputs[0].token_ids) for o in gained)
    return time.perf_counter() - start, tokens, counts


def resolved_args(llm: LLM) -> dict:
    """The engine settings vLLM chose (defaults filled in), for the record."""
    c = llm.llm_engine.vllm_config
    return {
        "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": c.scheduler_config.max_num_seqs,
        "max_model_len": c.model_config.max_model_len,
        "enable_chunked_prefill": c.scheduler_config.enable_chunked_prefill,
        "async_scheduling": getattr(c.scheduler_config, "async_scheduling", None),
        "enable_prefix_caching": c.cache_config.enable_prefix_caching,
        "block_size": c.cache_config.block_size,
        "num_gpu_blocks": c.cache_config.num_gpu_blocks,
        "gpu_memory_utilization": c.cache_config.gpu_memory_utilization,
        "kv_cache_memory_bytes": c.cache_config.kv_cache_memory_bytes,
        "cudagraph_mode": str(c.compilation_config.cudagraph_mode),
        "compilation_mode": str(c.compilation_config.mode),
        "dtype": str(c.model_config.dtype),
    }


def main() -> None:
    spec = SideSpec.read(sys.argv[1])
    args = dict(spec.engine_args)
    if spec.profile_dir:
        Path(spec.profile_dir).mkdir(parents=True, exist_ok=True)
        args["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(Path(spec.profile_dir).resolve()),
                                   "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
                                   "torch_profiler_dump_cuda_time_total": False}
    start = time.perf_counter()
    llm = LLM(model=spec.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0, **args)
    started = time.perf_counter() - start
    result = SideResult(
        call_id=spec.call_id, engine="vllm", label=spec.label, device=torch.cuda.get_device_name(0),
        versions={"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        engine_args={"asked": spec.engine_args, "resolved": resolved_args(llm)}, start_s=started,
    )
    workloads = [(w, w.prompts()) for w in spec.workloads]
    warm = workloads[0][1][: spec.warmup_prompts]
    generate(llm, [p[: spec.warmup_tokens] for p in warm], 8)  # the same warm-up vattn gets
    for round_ in range(spec.reps):
        for w, prompts in workloads:
            if w.stepwise:
                wall, tokens, counts = stepwise(llm, prompts, w.output)
                result.record(w.name, prompts, w.output, round_, wall, tokens, running=counts)
            else:
                followups = w.followups()
                wall, tokens, hit_rate = generate(llm, prompts, w.output, followups)
                result.record(w.name, prompts, w.output, round_, wall, tokens, followups, prefix_hit_rate=hit_rate)
            print(f"{spec.label} {w.name} round {round_}: {wall:.3f} s", flush=True)
    if spec.profile:
        prompts = dict((w.name, p) for w, p in workloads)[spec.profile]
        begun = time.time()  # the work directory may hold traces of earlier calls
        llm.start_profile()
        generate(llm, prompts, spec.profile_tokens)
        llm.stop_profile()
        # one trace per rank, named "{worker}.{id}.pt.trace.json.gz" ("rank0...", "rank1..."): each one's newest
        newest: dict[str, Path] = {}
        for trace in sorted(Path(spec.profile_dir).rglob("*.json.gz"), key=lambda p: p.stat().st_mtime):
            if trace.stat().st_mtime >= begun:
                newest[trace.name.split(".")[0]] = trace
        result.profile_traces = [str(newest[w]) for w in sorted(newest, key=lambda w: (len(w), w))]
        result.profile_trace = result.profile_traces[0] if newest else None
    result.write(sys.argv[2])
    del llm
    gc.collect()


if __name__ == "__main__":
    main()
