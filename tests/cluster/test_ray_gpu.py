"""The Ray engine on GPUs: worker actors with one GPU each, CUDA VMM caches inside them, CUDA graphs at
TP=1, NCCL between TP ranks and for PP hand-offs where the machine has two GPUs. Each against the in-process
engine on the same preset weights (bf16: the first token of every prompt must match, nearly all the rest)."""

from __future__ import annotations

import pytest

from tests.conftest import cuda_missing
from worker.sampling import SamplingParams

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")

from cluster.engine import LLM  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 99, 3, 250, 42, 7 * i % 200 + 3] * (i + 1) for i in range(6)]
KW = dict(dtype="bfloat16", max_num_seqs=8, max_model_len=256, kv_memory=256 << 20)


@pytest.fixture(scope="module")
def gpus():
    if cuda_missing():
        pytest.skip(cuda_missing())
    ray.init(include_dashboard=False, log_to_driver=False)
    yield int(ray.cluster_resources().get("GPU", 0))
    ray.shutdown()


@pytest.fixture(scope="module")
def want(gpus):
    with LLM("tiny", device="cuda", **KW) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(("tp", "pp", "layout"), [(1, 1, "mega"), (1, 1, "paged"), (2, 1, "mega"), (1, 2, "per_layer"),
                                                  (2, 1, "paged")])
def test_ray_workers_on_gpus_match_the_in_process_engine(gpus, want, tp, pp, layout):
    if tp * pp > gpus:
        pytest.skip(f"needs {tp * pp} GPUs, this machine has {gpus}")
    with LLM("tiny", distributed="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_layout=layout, **KW) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        snap = llm.snapshot()
    assert [g[0] for g in got] == [w[0] for w in want]
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.8 * sum(map(len, want)), f"only {same} of {sum(map(len, want))} tokens agree"
    graphs = tp * pp == 1 and layout != "paged"
    assert all(w.slots_in_use == (1 if graphs else 0) for w in snap.workers)  # the graphs' scratch slot only
    assert all(w.peak_mapped_bytes > 0 and w.busy_seconds > 0 for w in snap.workers)
