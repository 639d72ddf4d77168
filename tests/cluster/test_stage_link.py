"""``StageLink`` on its own: which ranks a stage's hand-off pairs; hidden states that do not match the step are
refused before anything is sent (the next stage would wait for rows that never come, or read the wrong ones); rows
reach the next stage over gloo, and closing waits for the send in flight. The hand-off in the engine runs in
``test_ray_engine.py``'s pipeline test (``pipeline_handoff="p2p"``), against the in-process engine's tokens."""

import pytest
import torch
import torch.multiprocessing as mp

from cluster.stage_link import StageLink
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


def _stage(rank: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        link = StageLink.between(rank, 1, 2)
        step = StepInput(3, seq_ids=(1,), token_ids=(5, 6), offsets=(0, 2))
        if rank == 0:
            assert link.send(step, torch.arange(16.0).view(2, 8)) == 2
            link.close()  # the send in flight done and let go of, before the group goes
            link.close()
        else:
            torch.save(link.receive(step, 8, torch.float32, torch.device("cpu")), out)
            link.close()  # nothing in flight on a last stage
    finally:
        torch.distributed.destroy_process_group()


def test_hidden_states_reach_the_next_stage_and_closing_waits_for_the_send(tmp_path):
    out = str(tmp_path / "received")
    mp.spawn(_stage, args=(f"file://{tmp_path}/rendezvous", out), nprocs=2, join=True)
    assert torch.equal(torch.load(out), torch.arange(16.0).view(2, 8))
