"""Pipeline stages on two Ray nodes (two raylets on this machine): the same tokens as transformers."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from cluster.engine import LLM  # noqa: E402
from tests.cluster.conftest import NEW_TOKENS  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_pp_stages_on_different_nodes_match_transformers(two_nodes, hf_llama):
    path, prompts, expected = hf_llama
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(path, distributed="ray", pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD", device="cpu",
             dtype="float32", max_model_len=128, page_size=4096, kv_memory=4 << 20) as llm:
        (group,) = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
        assert len(set(group["bundles_to_node_id"].values())) == 2  # one stage per node
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == expected
