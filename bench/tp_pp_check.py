"""TP / PP through Ray against TP=1 on one fixed batch: the top-k log-probabilities (log-softmax of the
logits) of the first tokens each request draws, greedy, on the same preset weights.

Reported per shape: the max abs error of the log-probs at the first position (the prefill's logits, same
context everywhere) and over every position up to where the greedy tokens first differ, and the share of
greedy tokens that agree. ``--float32-yardstick`` adds TP=1 bf16 against TP=1 float32: the error bf16 itself
makes on this model, the scale to read the others by.

    python bench/tp_pp_check.py [--model llama-3-8b] [--shapes 2x1 1x2] [--requests 16]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

import report
from cluster.engine import LLM
from worker.config import PRESETS
from worker.sampling import SamplingParams


def run(model: str, prompts, params, tp: int, pp: int, device: str, kv_memory: int, **kw) -> list:
    distributed = "ray" if tp * pp > 1 else "local"
    with LLM(model, distributed=distributed, tensor_parallel_size=tp, pipeline_parallel_size=pp, device=device,
             kv_memory=kv_memory, max_num_seqs=len(prompts), max_model_len=1024, **kw) as llm:
        return [o.outputs[0] for o in llm.generate(prompts, params)]


def compare(want, got) -> dict:
    first, matched, agree, total = 0.0, 0.0, 0, 0
    for w, g in zip(want, got):
        for pos, (a, b) in enumerate(zip(w.logprobs, g.logprobs)):
            common = set(a.top_logprobs) & set(b.top_logprobs)
            err = max(abs(a.top_logprobs[t] - b.top_logprobs[t]) for t in common)
            matched = max(matched, err)
            if pos == 0:
                first = max(first, err)
            if a.token_id != b.token_id:
                break
        agree += sum(x == y for x, y in zip(w.token_ids, g.token_ids))
        total += len(w.token_ids)
    return {"max_abs_err_first": first, "max_abs_err_matched": matched, "token_agreement": agree / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--shapes", nargs="+", default=["2x1", "1x2"], help="TPxPP")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--float32-yardstick", action="store_true", help="also TP=1 bfloat16 against float32")
    parser.add_argument("--kv-memory-gib", type=float, default=8, help="per worker")
    parser.add_argument("--out", type=Path, default=report.RESULTS)
    parser.add_argument("--name", default="tp_pp_check")
    args = parser.parse_args()
    rng = random.Random(0)
    vocab = PRESETS[args.model].vocab_size
    prompts = [[rng.randrange(min(1000, vocab // 2), vocab - 1) for _ in range(rng.randint(64, 512))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=20)
    kv = int(args.kv_memory_gib * (1 << 30))
    want = run(args.model, prompts, params, 1, 1, args.device, kv)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    rows, results = [], {}
    if args.float32_yardstick:  # how far bf16 itself is from float32 on this model: the scale for the rest
        r = compare(run(args.model, prompts, params, 1, 1, args.device, kv, dtype="float32", attention="torch"), want)
        results["bf16 vs float32"] = r
        rows.append(["TP=1 bf16 vs TP=1 float32", r["max_abs_err_first"], r["max_abs_err_matched"], r["token_agreement"]])
    for shape in args.shapes:
        tp, pp = map(int, shape.split("x"))
        r = compare(want, run(args.model, prompts, params, tp, pp, args.device, kv))
        results[shape] = r
        rows.append([f"TP={tp} x PP={pp}", r["max_abs_err_first"], r["max_abs_err_matched"], r["token_agreement"]])
    headers = ["shape (vs TP=1 in-process)", "max |dlogprob| first token", "max |dlogprob| until tokens differ",
               "greedy tokens agreeing"]
    report.write(args.name, headers, rows, {"model": args.model, "requests": args.requests, "tokens": args.tokens,
                                            "dtype": "bfloat16 on cuda, float32 on cpu", "results": results}, args.out)


if __name__ == "__main__":
    main()
