"""The Ray engine on GPUs: worker actors with one GPU each, CUDA VMM caches inside them, CUDA graphs (on every
TP rank and PP stage), peer memory and NCCL between TP ranks and NCCL for the PP hand-off where the machine has
two GPUs. Each against the
in-process engine on the same preset weights and kernels, token for token: TP=1 in bf16 with FA2, the
multi-GPU shapes in float32 with the reference attention (bf16 sums split over TP ranks round differently,
and random weights leave near-ties that flip; bench/tp_pp_check.py measures that error in bf16)."""

from __future__ import annotations

import pytest

from tests.conftest import cuda_missing
from worker.sampling import SamplingParams

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")

from cluster.engine import LLM  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 99, 3, 250, 42, 7 * i % 200 + 3] * (i + 1) for i in range(6)]
KW = dict(max_num_seqs=8, max_model_len=256, kv_memory=256 << 20)
BF16 = dict(dtype="bfloat16")
FP32 = dict(dtype="float32", attention="torch")


@pytest.fixture(scope="module")
def gpus():
    if cuda_missing():
        pytest.skip(cuda_missing())
    ray.init(include_dashboard=False, log_to_driver=False)
    yield int(ray.cluster_resources().get("GPU", 0))
    ray.shutdown()


# TP's sums go through peer memory by default (float32 sums: exact, as NCCL's); this puts every one on NCCL
NCCL = dict(disable_custom_all_reduce=True)
P2P = dict(pipeline_handoff="p2p")  # the stages hand hidden states on themselves (cluster/stage_link.py)
RING = dict(pipeline_handoff="ring")  # ... and the last stage's tokens go back to the first on the device


@pytest.mark.parametrize(("tp", "pp", "layout", "numerics"), [
    (1, 1, "mega", BF16), (1, 1, "paged", BF16), (2, 1, "mega", FP32), (1, 2, "per_layer", FP32), (2, 1, "paged", FP32),
    (2, 2, "mega", FP32), (2, 1, "mega", FP32 | NCCL), (2, 2, "mega", FP32 | NCCL), (1, 2, "mega", FP32 | P2P),
    (2, 2, "mega", FP32 | P2P), (1, 2, "mega", FP32 | RING), (2, 2, "mega", FP32 | RING),
])
def test_ray_workers_on_gpus_match_the_in_process_engine(gpus, tp, pp, layout, numerics):
    if tp * pp > gpus:
        pytest.skip(f"needs {tp * pp} GPUs, this machine has {gpus}")
    with LLM("tiny", device="cuda", kv_layout=layout, **numerics, **KW) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        # the in-process engine's plan, the same for both: CUDA graphs with an in-place kernel (bf16 here)
        # (the paged layout has one where flash-attn imports)
        graphs = llm.core.plan.cuda_graphs
    with LLM("tiny", distributed="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_layout=layout,
             **numerics, **KW) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        snap = llm.snapshot()
    assert got == want
    assert all(w.slots_in_use == (1 if graphs else 0) for w in snap.workers)  # the graphs' scratch slot only
    assert all(w.peak_mapped_bytes > 0 and w.busy_seconds > 0 for w in snap.workers)
    assert all(w.peer_all_reduce == (tp > 1 and "disable_custom_all_reduce" not in numerics) for w in snap.workers)


def test_a_kv_memory_fraction_sizes_the_gpu_workers_pools(gpus):
    # Half of an 80 GiB GPU is far past what 8 running slots of 256 tokens of `tiny` can map: the pools stop there, on
    # every worker, after each measured its GPU; the tokens are the fixed-pool engine's.
    from cluster.config import EngineConfig, model_config, plan

    kw = {k: v for k, v in KW.items() if k != "kv_memory"}
    with LLM("tiny", device="cuda", **BF16, **KW) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    with LLM("tiny", distributed="ray", device="cuda", kv_memory_fraction=0.5, **BF16, **kw) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        (worker,) = llm.snapshot().workers
    sized = plan(EngineConfig("tiny", device="cuda", **BF16, **kw), model_config("tiny"), "cuda")
    running = sized.config.max_num_seqs + (1 if sized.cuda_graphs else 0)  # the pool stops at the running slots full, not the spare ones
    assert worker.total_pages == running * sized.ledger_spec.pages_for(256)
    assert got == want


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_two_gpus_decode_in_cuda_graphs_and_agree_with_eager(gpus, tp, pp):
    # TP: each rank captures its shard's decode graphs with the all-reduces (peer memory) inside; PP: each stage its
    # layers, the hand-off outside. bf16, so against the same engine run eagerly: the first token of every prompt
    # the same (prefill runs eagerly in both) and nearly all the rest.
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpus}")
    runs = {}
    for graphs in (False, True):
        with LLM("tiny", distributed="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp, attention="fa2",
                 cuda_graphs=graphs, **BF16, **KW) as llm:
            runs[graphs] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
            # the graphs hold their scratch slot: on every rank when they are on
            assert all(w.slots_in_use == (1 if graphs else 0) for w in llm.snapshot().workers)
            assert all(w.peer_all_reduce == (tp > 1) for w in llm.snapshot().workers)  # the TP ranks see each other
    eager, graphed = runs[False], runs[True]
    assert [g[0] for g in graphed] == [e[0] for e in eager]
    same = sum(a == b for g, e in zip(graphed, eager) for a, b in zip(g, e))
    assert same >= 0.8 * sum(map(len, eager)), f"only {same} of {sum(map(len, eager))} tokens agree"
