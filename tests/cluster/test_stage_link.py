"""``StageLink`` on its own: which ranks a stage's hand-off pairs, and hidden states that do not match the step are
refused before anything is sent (the next stage would wait for rows that never come, or read the wrong ones). The
hand-off itself runs in ``test_ray_engine.py``'s pipeline test (``pipeline_handoff="p2p"``), against the in-process
engine's tokens."""

import pytest
import torch

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
