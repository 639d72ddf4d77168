"""CUDA graphs of mixed steps: prefill chunks beside decode rows, up to a few thousand tokens, padded to a bucket of
tokens and to the decode graphs' sequence count, replayed instead of launching the step's ~370 kernels from Python.

Under arrivals spread in time, every few steps holds a new prompt beside the running decodes. On the H200 (llama-3-8b
shape, `bench/results/vattn_poisson_profile_h200.json`) such a step of 512 prompt tokens and 30-50 decode rows ran
13-16 ms of kernels, and its eager launch took the host 30-58 ms under the profiler, while the device waited: our
TPOT at 20 requests/s was 9.5-11.2 ms against vLLM's 6.5-7.4 ms, whose compiled steps replay piecewise graphs
(attention outside them). FlashAttention-3 runs a whole mixed step as one varlen call whose tiles its persistent scheduler
finds on the device from the sequences' lengths, so here the attention is inside the graph too: only backends that
say so (``graphs_mixed``: the ``fa3`` one) get these graphs.

Padding: the tokens past the step's belong to no sequence (``cu_seqlens_q`` ends at the step's last token), their
rows are computed and never read, and their K/V go to the scratch slot's first row; the sequences past the step's
have no query and no KV. A step asking for prompt logprobs runs eagerly.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from worker.attention import AttentionBackend, AttentionMetadata, AttentionStep
from worker.graphs import StepGraphs
from worker.model import Transformer
from worker.parallel import TPGroup
from worker.rope import rope_for
from worker.staging import to_device

#: Token counts mixed-step graphs are captured for: multiples of 64 up to 1024 (a 512-token prompt beside up to ~500
#: decode rows pads by under 64), then coarser up to 2048 (``mixed_graph_tokens``' suggested cap: a step of more
#: tokens runs long enough on the device for its eager launch to hide behind it).
TOKEN_BUCKETS = (*range(64, 1025, 64), 1280, 1536, 1792, 2048)
PAST_BUCKETS = 512  # the step between sizes past ``TOKEN_BUCKETS``' last


def token_sizes(max_tokens: int) -> list[int]:
    """The sizes of graphs of up to ``max_tokens`` tokens: ``TOKEN_BUCKETS``, multiples of ``PAST_BUCKETS`` past
    them, and ``max_tokens`` itself."""
    past = range(TOKEN_BUCKETS[-1] + PAST_BUCKETS, max_tokens, PAST_BUCKETS)
    return sorted({b for b in (*TOKEN_BUCKETS, *past) if b < max_tokens} | {max_tokens})


def mixed_inputs(chunks, size: int, max_seqs: int, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixed step's inputs padded to ``size`` tokens and ``max_seqs`` sequences: ``[3, size]`` int64 rows of each
    token's id, position and slot (padding: id 0 at position 0 of ``scratch``), and ``[3, max_seqs + 1]`` int32 rows
    of the sequences' query offsets (``cu_seqlens_q``: the padding sequences start and end at the last real token),
    their KV lengths and slots (padding: none in ``scratch``; the last column of these two is never read)."""
    lengths = [len(c.token_ids) for c in chunks]
    n, pad, seqs_pad = sum(lengths), size - sum(lengths), max_seqs - len(chunks)
    if pad < 0 or seqs_pad < 0:
        raise ValueError(f"a mixed step of {n} tokens in {len(chunks)} sequences does not fit {size} tokens in "
                         f"{max_seqs} sequences")
    tokens = torch.tensor([
        [t for c in chunks for t in c.token_ids] + [0] * pad,
        [p for c in chunks for p in range(c.start, c.start + len(c.token_ids))] + [0] * pad,
        [c.slot for c, k in zip(chunks, lengths) for _ in range(k)] + [scratch] * pad,
    ])
    seqs = torch.tensor([
        list(accumulate(lengths, initial=0)) + [n] * seqs_pad,
        [c.start + k for c, k in zip(chunks, lengths)] + [0] * (seqs_pad + 1),
        [c.slot for c in chunks] + [scratch] * (seqs_pad + 1),
    ], dtype=torch.int32)
    return tokens, seqs


class MixedGraphs(StepGraphs):
    def __init__(self, model: Transformer, cache, backend: AttentionBackend, rope_table: torch.Tensor, max_seqs: int,
                 max_tokens: int, scratch: int, tp: TPGroup = TPGroup()):
        """Graphs of steps of up to ``max_seqs`` sequences and ``max_tokens`` tokens over a virtual cache with
        ``backend`` (one that ``graphs_mixed``); ``scratch``: a slot the caller holds, one token backed. A graph ends
        at the layers (``Transformer.forward``'s output): the caller picks the rows it samples and makes their logits,
        as an eager step does. TP ranks capture and replay in lock-step, as ``DecodeGraphs``'s do."""
        if not getattr(backend, "graphs_mixed", False) or backend.reads != "slots":
            raise ValueError(f"mixed-step CUDA graphs need an attention backend that runs a mixed step in one call over "
                             f"a virtual cache (fa3), got {type(backend).__name__}")
        super().__init__(model, cache, backend, rope_table, token_sizes(max_tokens), scratch, tp)
        self.max_seqs = max_seqs
        self.tokens = torch.zeros(3, self.sizes[-1], dtype=torch.long, device=self.device)
        self.seqs = torch.zeros(3, max_seqs + 1, dtype=torch.int32, device=self.device)
        self.hidden = None if model.is_first else torch.zeros(self.sizes[-1], model.config.hidden_size,
                                                              dtype=self.dtype, device=self.device)

    def fits(self, chunks) -> bool:
        return len(chunks) <= self.max_seqs and sum(len(c.token_ids) for c in chunks) <= self.sizes[-1]

    def run(self, chunks, fill=None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Replay a mixed step: the last layer's output ``[tokens, hidden]``, a row per token of ``chunks`` (read it
        before the next replay); ``fill``: a ``TokenFill`` of tokens still on the device; ``hidden``: the previous
        stage's output (a stage after the first)."""
        self.capture()
        n = sum(len(c.token_ids) for c in chunks)
        size = next(s for s in self.sizes if s >= n)
        tokens, seqs = mixed_inputs(chunks, size, self.max_seqs, self.scratch)
        self.tokens[:, :size].copy_(to_device(tokens, self.device))
        self.seqs.copy_(to_device(seqs, self.device))
        if fill is not None:
            ends = list(accumulate(len(c.token_ids) for c in chunks))
            fill.apply(self.tokens[0], [ends[i] - 1 for i in fill.chunks])
        if self.hidden is not None:
            self.hidden[:n].copy_(hidden, non_blocking=True)
        return self._replay(size)[:n]

    def _pad_all(self) -> None:
        tokens, seqs = mixed_inputs((), self.sizes[-1], self.max_seqs, self.scratch)
        self.tokens.copy_(tokens)
        self.seqs.copy_(seqs)

    def _forward(self, size: int) -> torch.Tensor:
        tokens, positions, slots_of = self.tokens[:, :size]
        cu_seqlens_q, used, slots = self.seqs
        stride = self.cache.spec.slot_tokens  # token t of slot s is row s * slot_tokens + t (cache.token_rows)
        seq_starts = slots * stride
        meta = AttentionMetadata(
            seqs=(),
            write_rows=slots_of * stride + positions,
            kv_rows=None,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=seq_starts,  # read only by gathering backends, which never run in a graph
            seq_starts=seq_starts,
            seqused_k=used[:-1],
            slots=slots[:-1],
            slot_tokens=stride,
            # FA3's bound on a sequence's query length, the same at every replay of this size: its tiles come from
            # cu_seqlens_q on the device
            max_query_len=size,
            max_kv_len=self.cache.spec.max_tokens,
        )
        x = tokens if self.hidden is None else self.hidden[:size]
        return self.model(x, rope_for(self.rope_table, positions, self.dtype), AttentionStep(self.cache, self.backend, meta))
