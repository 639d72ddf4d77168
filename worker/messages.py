"""What a scheduler sends a worker each step, and what comes back.

Modelled on vLLM v1's ``SchedulerOutput``: a sequence's sampling state travels once (``NewSeq``), then
each step carries only the batch as columns of ints, the KV operations every worker applies in the same
order, and the mapping plan for the next step. A decode step of B sequences is a few ints per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.ops import KVOp
from worker.sampling import SampledToken, SamplingParams


#: A token id the scheduler does not know yet: the one its worker sampled for that sequence in the step
#: before (async scheduling sends step k+1 before step k's tokens came back). Only ever a chunk's last.
PLACEHOLDER = -1


@dataclass(frozen=True, slots=True)
class NewSeq:
    """Sampling state of a sequence, sent with the first step that schedules it."""

    seq_id: int
    params: SamplingParams
    seed: int
    sample_index: int
    # Penalized sequences and those asking prompt logprobs only: the prompt, and the output the scheduler knew when
    # it sent this.
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepInput:
    """One step for every worker. The batch is column-wise: chunk i is ``token_ids[offsets[i]:offsets[i+1]]``
    of sequence ``seq_ids[i]`` at positions ``starts[i]..`` of ``slots[i]``, drawing ``num_samples[i]`` tokens."""

    step: int
    new_seqs: tuple[NewSeq, ...] = ()
    finished_seqs: tuple[int, ...] = ()  # forget these sequences' state
    kv_ops: tuple[KVOp, ...] = ()  # applied in order before the step runs
    ahead: dict[int, int] = field(default_factory=dict)  # slot -> tokens, mapped while the step computes
    seq_ids: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()
    num_samples: tuple[int, ...] = ()
    output_index: tuple[int, ...] = ()  # tokens each sequence has generated so far (seeds its sampler)
    token_ids: tuple[int, ...] = ()
    offsets: tuple[int, ...] = (0,)
    allowed: dict[int, bytes] = field(default_factory=dict)  # seq_id -> its grammar's bitmask of the next token
    banned: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq_id -> token ids its bad words ban now
    # Sequences whose grammar mask follows once the token in flight before it is read (``Worker.supply_masks``):
    # the step's forward pass is queued now, its draw when the masks come.
    late_masks: tuple[int, ...] = ()
    # The late masks of the step in flight, where they travel with the next call (a Ray worker that launches
    # ahead): drawn before this step is launched, as this step reads the tokens drawn.
    prior_masks: dict[int, bytes | None] | None = None
    # ``SlotCache.eager_map``'s arguments (tokens, slots, pages, drop), run after ``ahead``: free slots given pages
    # for the requests to come (``PageLedger.eager_ahead``); empty: none.
    eager: tuple = ()
    # ``SlotCache.map_prefixes_ahead``'s (slot, keys) pairs, run after those: waiting requests' cached prefixes mapped
    # into free slots (``PageLedger.prefix_ahead``); None: none.
    prefixes: tuple | None = None


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """A worker's KV pool after a step: counters only, cheap to read every step."""

    pp_rank: int
    tp_rank: int
    slots_in_use: int
    mapped_bytes: int
    free_pages: int  # slot pages the pool can still hand out
    maps: int  # cumulative
    unmaps: int
    stall_seconds: float
    busy_seconds: float  # cumulative time inside step execution (KV ops, the step, waiting for the mapper)
    swap_bytes: int
    map_latency_us: tuple[float, ...]  # samples since the previous report
    # cumulative device time of its steps (CUDA; 0 elsewhere): a run's wall time less this is the device idle
    device_seconds: float = 0.0
    peer_all_reduce: bool = False  # TP sums through peer memory (``worker.peer_all_reduce``), else NCCL alone


@dataclass(frozen=True)
class WorkerOutput:
    """``sampled`` (seq_id -> token ids) and ``logprobs`` (for the sequences that asked) are filled by the
    sampling worker only (last stage, TP rank 0)."""

    sampled: dict[int, tuple[int, ...]]
    report: WorkerReport
    logprobs: dict[int, tuple[SampledToken, ...]] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, tuple[SampledToken, ...]]] = field(default_factory=dict)  # StepOutput's
    step: int = -1  # the StepInput this is the result of (a worker that launches ahead answers one call late)
