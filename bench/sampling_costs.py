"""What penalties and structured outputs cost the engine: W1 plain, W1 with penalties on every request, and W1 with a
JSON schema on half of its requests, in one process, alternating (plain, penalties, schema, schema, penalties,
plain) after a warm-up of each. Issue 23's targets: penalties <= 3%, grammar <= 10% of plain W1's wall.

Every request decodes its full ``--output`` tokens (EOS ignored; the schema asks for more numbers than that, so no
answer ends it early). The grammar needs ``llguidance``; with a preset the tokenizer is the byte tokenizer, whose
small vocabulary makes a mask cheaper to compute than a real model's would (say so beside the numbers).

    python bench/sampling_costs.py [--model llama-3-8b] [--requests 128] [--name sampling_costs_h100]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace

import torch

import report
from cluster.engine import LLM
from throughput import random_prompts, workload_options
from worker.config import PRESETS
from worker.sampling import SamplingParams, StructuredOutputs

GiB = 1 << 30
# An array of more integers than any answer has tokens for: the grammar stays open to the last token. Compact
# (llguidance's option) so that random weights write numbers, not whitespace.
SCHEMA = {"type": "object", "required": ["values"], "additionalProperties": False,
          "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 4096}},
          "x-guidance": {"whitespace_flexible": False}}
ORDER = ("plain", "penalties", "schema", "schema", "penalties", "plain")


def modes(requests: int, output: int) -> dict[str, list[SamplingParams]]:
    greedy = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    penalized = replace(greedy, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    schema = replace(greedy, structured_outputs=StructuredOutputs(json=SCHEMA))
    return {"plain": [greedy] * requests, "penalties": [penalized] * requests,
            "schema": [schema if i % 2 else greedy for i in range(requests)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_options(parser)
    parser.add_argument("--kv-memory-gib", type=float, default=40)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default="sampling_costs")
    args = parser.parse_args()
    prompts = random_prompts(PRESETS[args.model], args.requests, args.min_prompt, args.max_prompt)
    params = modes(args.requests, args.output)
    # Prefix caching off: every run sends the same prompts, and a cached run would skip their prefill (the first
    # such run on the H100 took 5.7 s, the later ones ~2 s), leaving the costs over decode alone.
    engine = dict(kv_memory=int(args.kv_memory_gib * GiB), max_num_seqs=args.requests, device=args.device,
                  max_model_len=args.max_prompt + args.output, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=False)
    walls: dict[str, list[float]] = {name: [] for name in params}
    with LLM(args.model, **engine) as llm:
        for name in params:  # warm-up: kernels, the grammar compiled once, penalty buffers
            llm.generate([p[: args.min_prompt // 4] for p in prompts[:8]], params[name][:8])
        for name in ORDER:
            gc.collect()
            start = time.perf_counter()
            outs = llm.generate(prompts, params[name])
            walls[name].append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.output for o in outs), f"{name}: an answer ended early"
            if name == "schema":  # the odd requests are held to the schema
                assert all(outs[i].outputs[0].text.startswith('{"values":[') for i in range(1, len(outs), 2))
            print(f"{name}: {walls[name][-1]:.3f} s", flush=True)
        resolved = {"attention": llm.core.plan.attention, "kv_layout": llm.core.plan.config.kv_layout}
    plain = statistics.mean(walls["plain"])
    rows = [[name, statistics.mean(w), min(w), max(w), statistics.mean(w) / plain] for name, w in walls.items()]
    report.write(args.name, ["mode", "mean wall s", "min", "max", "x plain"], rows, {
        "workload": {"model": args.model, "requests": args.requests, "prompts": [args.min_prompt, args.max_prompt],
                     "output": args.output, "schema": SCHEMA, "penalties": {"presence": 0.5, "frequency": 0.5,
                                                                            "repetition": 1.1}},
        "order": ORDER, "engine": {**engine, **resolved}, "walls_s": walls,
        "ratios": {name: statistics.mean(w) / plain for name, w in walls.items()},
    })


if __name__ == "__main__":
    main()
