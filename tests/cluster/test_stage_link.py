"""``StageLink`` on its own: which ranks a stage's hand-off pairs; hidden states that do not match the step are
refused before anything is sent (the next stage would wait for rows that never come, or read the wrong ones); rows
reach the next stage over gloo, and over NCCL on two GPUs, where the link is opened before the first step (NCCL
makes the pair's communicator then); closing waits for the send in flight. The hand-off in the engine runs in
``test_ray_engine.py``'s pipeline test (``pipeline_handoff="p2p"``), against the in-process engine's tokens."""

import os
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from cluster.stage_link import StageLink
from tests.conftest import cuda_missing
from worker.messages import StepInput


@pytest.mark.parametrize(("rank", "tp", "pp", "prev", "next"), [
    (0, 1, 2, None, 1), (1, 1, 2, 0, None),
    (1, 2, 2, None, 3), (3, 2, 2, 1, None),  # pp-major: TP rank 1 of stage 0 hands on to TP rank 1 of stage 1
    (2, 2, 3, 0, 4),
])
def test_a_stage_hands_on_to_the_same_tp_rank_one_stage_away(rank, tp, pp, prev, next):
    link = StageLink.between(rank, tp, pp)
    assert (link.prev, link.next) == (prev, next)


def test_hidden_states_of_another_row_count_than_the_step_are_refused():
    step = StepInput(7, seq_ids=(1, 2), token_ids=(5, 6, 9), offsets=(0, 2, 3))
    with pytest.raises(ValueError, match="step 7: 2 rows of hidden states for 3 tokens"):
        StageLink(None, 1).send(step, torch.zeros(2, 8))
    assert StageLink(None, 1).send(StepInput(8), None) == 0  # a step without a batch sends nothing
    assert StageLink(0, None).receive(StepInput(8), 8, torch.float32, torch.device("cpu")) is None
    assert StageLink(None, 1).receive(step, 8, torch.float32, torch.device("cpu")) is None  # the first stage


def _stage(rank: int, init: str, out: str, backend: str) -> None:
    """One stage of two, ordered as the compiled graph orders them: the second receives only once the first's
    marker came, which the first gives only after its send returned."""
    device = torch.device("cpu")
    if backend == "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # one GPU each, as Ray lends them
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend, init_method=init, rank=rank, world_size=2)
    marker = torch.distributed.FileStore(f"{out}.marker", 2)
    marker.set_timeout(timedelta(seconds=60))
    try:
        link = StageLink.between(rank, 1, 2)
        link.connect(device)  # both stages at once, as WorkerActor.setup does
        step = StepInput(3, seq_ids=(1,), token_ids=(5, 6), offsets=(0, 2))
        if rank == 0:
            assert link.send(step, torch.arange(16.0, device=device).view(2, 8)) == 2
            marker.set("rows", "2")
            link.close()  # the send in flight done and let go of, before the group goes
            link.close()
        else:
            marker.wait(["rows"])  # over NCCL without ``connect`` the first send never returned: this timed out
            torch.save(link.receive(step, 8, torch.float32, device).cpu(), out)
            link.close()  # nothing in flight on a last stage
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_hidden_states_reach_the_next_stage_and_closing_waits_for_the_send(tmp_path, backend):
    if backend == "nccl" and (cuda_missing() or torch.cuda.device_count() < 2):
        pytest.skip(cuda_missing() or "needs 2 GPUs")
    out = str(tmp_path / "received")
    mp.spawn(_stage, args=(f"file://{tmp_path}/rendezvous", out, backend), nprocs=2, join=True)
    assert torch.equal(torch.load(out), torch.arange(16.0).view(2, 8))
