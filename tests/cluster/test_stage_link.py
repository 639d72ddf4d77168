"""``StageLink`` on its own: which ranks a stage's hand-off pairs; hidden states that do not match the step are
refused before anything is sent (the next stage would wait for rows that never come, or read the wrong ones); rows
reach the next stage over gloo, and over NCCL on two GPUs, where the link is opened before the first step (NCCL
makes the pair's communicator then); closing waits for the send in flight; a token ring hands each step's drawn tokens
from the last stage to the first, which takes them when it launches the step two launches later. The hand-off in the
engine runs in ``test_ray_engine.py``'s pipeline test (``pipeline_handoff="p2p"`` and ``"ring"``), against the
in-process engine's tokens."""

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


def test_a_token_ring_links_the_first_and_the_last_stages_same_tp_ranks():
    assert [(lk.prev, lk.next, lk.ring) for lk in (StageLink.between(r, 2, 3, ring=True) for r in range(6))] == [
        (None, 2, 4), (None, 3, 5), (0, 4, None), (1, 5, None), (2, None, 0), (3, None, 1)]
    assert StageLink.ring_pairs(2, 3) == [[0, 4], [1, 5]]
    assert [(lk.takes_back, lk.hands_back) for lk in (StageLink.between(r, 1, 3, ring=True) for r in range(3))] == [
        (True, False), (False, False), (False, True)]
    assert StageLink.between(0, 1, 2).ring is None  # the p2p hand-off alone


def test_hidden_states_of_another_row_count_than_the_step_are_refused():
    step = StepInput(7, seq_ids=(1, 2), token_ids=(5, 6, 9), offsets=(0, 2, 3))
    with pytest.raises(ValueError, match="step 7: 2 rows of hidden states for 3 tokens"):
        StageLink(None, 1).send(step, torch.zeros(2, 8))
    assert StageLink(None, 1).send(StepInput(8), None) == 0  # a step without a batch sends nothing
    assert StageLink(0, None).receive(StepInput(8), 8, torch.float32, torch.device("cpu")) is None
    assert StageLink(None, 1).receive(step, 8, torch.float32, torch.device("cpu")) is None  # the first stage


def _join(rank: int, init: str, backend: str) -> torch.device:
    """This process's device in a group of two: over NCCL one GPU each, as Ray lends them."""
    device = torch.device("cpu")
    if backend == "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend, init_method=init, rank=rank, world_size=2)
    return device


def _stage(rank: int, init: str, out: str, backend: str) -> None:
    """One stage of two, ordered as the compiled graph orders them: the second receives only once the first's
    marker came, which the first gives only after its send returned."""
    device = _join(rank, init, backend)
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


def _ring_stage(rank: int, init: str, out: str, backend: str) -> None:
    """Two stages in a token ring: the last draws tokens for steps 0-3 (step 2 draws none) and hands them back
    without waiting; the first, at each launch, takes the tokens of the step launched two before, then a step without
    a batch takes what is left."""
    device = _join(rank, init, backend)
    try:
        (pair,) = StageLink.ring_pairs(1, 2)
        group = torch.distributed.new_group(pair)
        link = StageLink.between(rank, 1, 2, ring=True)
        link.ring_group = group
        link.connect(device)
        steps = [StepInput(s, seq_ids=(10 + s, 20 + s), token_ids=(5, 6), offsets=(0, 1, 2),
                           num_samples=(0, 0) if s == 2 else (1, 1)) for s in range(4)]
        if rank == 1:
            for s, step in enumerate(steps):
                if any(step.num_samples):
                    link.hand_back(torch.tensor([100 + s, 200 + s], device=device))
            link.close()  # waits for the sends, which the first stage's step without a batch receives
        else:
            taken = [link.take_back(step) for step in steps] + [link.take_back(StepInput(9))]
            torch.save([None if t is None else (t[0].cpu().tolist(), t[1]) for t in taken], out)
            link.close()
    finally:
        torch.distributed.destroy_process_group()


def _two_stages(stage, tmp_path, backend: str):
    """What ``stage(rank, init, out, backend)`` saved, run as two stages (over NCCL: two GPUs, one each)."""
    if backend == "nccl" and (cuda_missing() or torch.cuda.device_count() < 2):
        pytest.skip(cuda_missing() or "needs 2 GPUs")
    out = str(tmp_path / "saved")
    mp.spawn(stage, args=(f"file://{tmp_path}/rendezvous", out, backend), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_a_token_ring_hands_each_steps_tokens_to_the_step_two_launches_later(tmp_path, backend):
    # launches 0 and 1 take nothing yet; 2 takes step 0's tokens, 3 step 1's; step 3's come with the step without a
    # batch (returned to nobody), and step 2 drew none
    assert _two_stages(_ring_stage, tmp_path, backend) == [
        None, None, ([100, 200], {10: 0, 20: 1}), ([101, 201], {11: 0, 21: 1}), None]


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_hidden_states_reach_the_next_stage_and_closing_waits_for_the_send(tmp_path, backend):
    assert torch.equal(_two_stages(_stage, tmp_path, backend), torch.arange(16.0).view(2, 8))
