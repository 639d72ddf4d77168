"""``deterministic=True`` (tiny model, float32, CPU): every request gets the same tokens and bit-for-bit the same
logprobs whatever else is in the batch -- alone, among 32 random others, under a batch cap of 7, chunked into
32-token steps, preempted under a small KV pool, and on Ray -- greedy and seeded. Without it, the same experiment
gives other logprobs: the library matmul sums a row in an order that depends on the batch."""

from __future__ import annotations

import json
import random

import pytest

from cluster.config import EngineConfig, model_config, plan
from cluster.engine import LLM
from tests.conftest import cuda_missing
from worker.sampling import SamplingParams

BASE = dict(device="cpu", max_model_len=256, page_size=4096, kv_memory=8 << 20)
SETTINGS = {  # name -> engine options: each runs the same 33 requests
    "alone": dict(max_num_seqs=1),
    "batched": dict(max_num_seqs=33),
    "capped at 7": dict(max_num_seqs=7),
    "chunked": dict(max_num_seqs=33, max_num_batched_tokens=32),
    "preempted": dict(max_num_seqs=33, kv_memory=256 << 10),
}


def prompts(n: int = 33, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randint(3, 250) for _ in range(rng.randint(5, 90))]} for _ in range(n)]


def outputs(params: list[SamplingParams], deterministic: bool = True, **options) -> tuple[list, int]:
    """Each request's (token ids, logprobs), and how many preemptions the run took."""
    with LLM("tiny", deterministic=deterministic, **{**BASE, **options}) as llm:
        outs = llm.generate(prompts(), params)
        preemptions = llm.snapshot().num_preemptions
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs], preemptions


def greedy() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)] * 33


def seeded() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=100 + k, ignore_eos=True, logprobs=2)
            for k in range(33)]


@pytest.mark.parametrize("params", [greedy, seeded])
def test_every_request_gets_the_same_tokens_and_logprobs_in_every_batch(params):
    runs = {name: outputs(params(), **options) for name, options in SETTINGS.items()}
    assert_alike(runs)


@pytest.mark.gpu
def test_on_cuda_in_bf16_with_graphs_every_request_is_the_same_in_every_batch(tmp_path):
    """The Triton kernels (matmul, attention), CUDA-graph decode steps beside eager mixed ones, async scheduling: a
    model of 128 tokens a 2 MiB page, so that a small pool preempts."""
    if cuda_missing():
        pytest.skip(cuda_missing())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16,
              "head_dim": 128, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = str(tmp_path)
    engine = plan(EngineConfig(model=model, deterministic=True, device="cuda", load_format="dummy"),
                  model_config(model), "cuda")
    assert engine.attention == "invariant" and engine.cuda_graphs
    rng = random.Random(0)
    requests = [{"prompt_token_ids": [rng.randint(3, 500) for _ in range(rng.randint(20, 300))]} for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(10, 150), temperature=t, top_p=0.95, seed=k, ignore_eos=True, logprobs=2)
              for k, t in enumerate([0.0, 0.9] * 12)]
    gpu = dict(load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=512, deterministic=True)
    runs = {}
    for name, options in {"alone": dict(max_num_seqs=1), "batched": dict(max_num_seqs=24), "capped at 7": dict(max_num_seqs=7),
                          "chunked": dict(max_num_seqs=24, max_num_batched_tokens=64),
                          "preempted": dict(max_num_seqs=24, kv_memory=8 * 2 * (2 << 20))}.items():
        with LLM(model, **{"kv_memory": 256 << 20, **gpu, **options}) as llm:
            outs = llm.generate(requests, params)
            runs[name] = ([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs],
                          llm.scheduler.num_preemptions)
    assert_alike(runs)


def assert_alike(runs: dict) -> None:
    assert runs["preempted"][1] > 0 and runs["batched"][1] == 0
    want = runs["alone"][0]
    for name, (got, _) in runs.items():
        differ = [k for k in range(len(want)) if got[k] != want[k]]
        assert not differ, f"{name}: requests {differ} differ from their runs alone"


def test_without_it_a_request_alone_and_in_a_batch_differ():
    alone, _ = outputs(greedy(), deterministic=False, **SETTINGS["alone"])
    batched, _ = outputs(greedy(), deterministic=False, **SETTINGS["batched"])
    assert alone != batched  # what the test above would catch: a kernel whose sums depend on the batch


def test_deterministic_takes_the_invariant_attention_and_refuses_another():
    engine = plan(EngineConfig(deterministic=True, device="cpu"), model_config("tiny"), "cpu")
    assert engine.attention == "invariant" and all(w.deterministic for w in engine.workers)
    with pytest.raises(ValueError, match=r"deterministic=True runs the batch-invariant attention \('invariant'\); "
                                         r"attention='torch' sums in an order that depends on the batch"):
        plan(EngineConfig(deterministic=True, attention="torch"), model_config("tiny"), "cpu")
    with pytest.raises(ValueError, match="deterministic must be a bool, got 'yes'"):
        plan(EngineConfig(deterministic="yes"), model_config("tiny"), "cpu")


def test_on_ray_the_same_as_in_process_and_at_tp2_the_same_in_every_batch():
    ray = pytest.importorskip("ray")
    want, _ = outputs(greedy(), **SETTINGS["batched"])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        assert outputs(greedy(), distributed="ray", max_num_seqs=7)[0] == want
        # Two ranks sum other partial products than one: the same in every batch, not the same as TP=1.
        tp2 = [outputs(greedy(), distributed="ray", tensor_parallel_size=2, **SETTINGS[name])[0]
               for name in ("batched", "capped at 7")]
        assert tp2[0] == tp2[1]
    finally:
        ray.shutdown()
