"""EngineConfig and the plan made from it before anything loads: layer ranges, KV specs and pools per
worker, and the scheduler's page ledger.

Every worker must keep the same page arithmetic as the scheduler's ledger, so that replaying the ledger's
operations keeps all of them in lock-step: the same tokens per page (the ``mega`` layout of an uneven
pipeline split is padded to the largest stage) and the same number of slot pages (each pool is sized to
the tightest worker's count under ``kv_memory``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from kvmem import KVCacheSpec
from cluster.scheduler import SchedulerConfig
from kvmem.ledger import PageLedger
from worker.attention import FLASHINFER_HEAD_DIMS, IN_PLACE, PAGED_KERNELS
from worker.config import PRESETS, ModelConfig
from worker.worker import WorkerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine. ``kv_memory`` is the physical KV pool of each worker (each GPU), in bytes;
    ``kv_memory_fraction``, when set, sizes it instead: that share of the memory free on each worker's device
    once its weights have loaded (on CPU, of the host's available memory split between the workers), the
    tightest worker's count for all, and never more than every slot full would map. ``gpu_memory_utilization``
    (vLLM's option) sizes it instead as the share of each GPU's whole memory the engine may use: the pool takes
    what is free beyond ``1 - gpu_memory_utilization`` of it once the weights are in.
    ``distributed="ray"`` runs a scheduler actor and one worker actor per (pp stage, tp rank)."""

    model: str = "tiny"
    tokenizer: str | None = None  # a directory with a tokenizer.json, instead of the model's (vLLM's --tokenizer)
    chat_template: str | None = None  # a Jinja template, or a file holding one, instead of the model's
    kv_layout: str = "mega"
    attention: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_memory: int = 1 << 30
    kv_memory_fraction: float | None = None
    gpu_memory_utilization: float | None = None
    page_size: int = 2 << 20
    map_ahead: bool = True  # map the next step's pages while this one runs (False: in the step; for measurement)
    # Free slots the mapper keeps holding pages for the next new requests, filled beside the steps, so that a new
    # prompt is written where pages are mapped already (virtual layouts, with map_ahead); 0: each new request maps
    # its prompt's pages in its step's launch.
    eager_slots: int = 64
    deferred_reclamation: bool = True  # freed slots keep their pages mapped for the next request (virtual layouts)
    enable_prefix_caching: bool = True  # full blocks of finished and running requests' tokens are reused (vLLM's name)
    # Virtual layouts, with prefix caching: a cached prefix of at least this many pages, on its first reuse in a slot
    # that does not hold it, is copied into one allocation that every later request maps in one driver call a buffer
    # (a mapping costs about the same whatever the allocation's size: bench/vmm_run_costs.py); 0: off, each request
    # maps it a page at a time. Being measured (bench/peer.py's vattn-fused side).
    fused_prefix_pages: int = 0
    # A read-only zero page over unmapped KV space (virtual layouts): a stray read sees zeros, not a fault that loses
    # the CUDA context. Off by default: every in-place kernel reads only mapped pages (the GPU tests run them over
    # unbacked space), and with it the decode-heavy workload ran 4% slower on the H100 (docs/performance.md).
    zero_unmapped: bool = False
    # With zero_unmapped (ignored without): the zero page backs only this many tokens past each slot's mapped pages (the farthest a
    # kernel's tile reads past a sequence: every in-place backend passed with 256 on the H100), the rest stays
    # unbacked; None backs all of it, at about twice the driver time a mapped page (bench/README.md).
    kv_guard_tokens: int | None = 256
    block_size: int | None = None  # tokens per block of the ``paged`` layout: 256 for flash-attn's kernel, else 16
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space: int = 4 << 30
    dtype: str = "auto"
    device: str | None = None
    load_format: Literal["auto", "dummy"] = "auto"  # "dummy": random weights at a model directory's shape
    cuda_graphs: bool | None = None
    # With CUDA graphs, steps of up to this many tokens that prefill replay graphs too, where the attention backend
    # runs a mixed step in one call (fa3; worker/mixed_graphs.py): under arrivals spread in time a new prompt beside the
    # running decodes made an eager step whose launch outlasted its kernels (on the H200 at 40 requests/s: TPOT p50
    # 0.53x, TTFT p50 0.60x with them, bench/results/serving_mixed_graphs_ab_h200.json). 0: such steps run eagerly.
    # None: MIXED_GRAPH_TOKENS on one GPU; 0 across GPUs (TP/PP), where the graphs have not been run yet.
    # (vLLM's nearest: max_cudagraph_capture_size.)
    mixed_graph_tokens: int | None = None
    seed: int = 0
    progress: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Steps in flight with pipeline stages, each a micro-batch of other sequences (None: one a stage). One more than
    # the stages keeps every stage busy while the scheduler takes a micro-batch's tokens and sends the next.
    pipeline_micro_batches: int | None = None
    # How a stage's hidden states reach the next: "channel", the compiled graph's (GPU to GPU over NCCL with one TP
    # rank a stage, host memory with several); "p2p", the stages' own torch.distributed send and receive, the receive
    # queued before a stage maps and plans its step, so that host work overlaps the stage before's compute
    # (cluster/stage_link.py); "ring", p2p and the last stage hands each step's drawn tokens back to the first on the
    # device, so that a micro-batch's next step is launched before the scheduler has read its tokens (one more step
    # in flight; the stages never wait for the host's round trip). "auto": "ring" where it applies (async scheduling, a
    # micro-batch a stage), else "channel". On 2xH200, W1 at PP=2 in one call took 3.77 / 3.80 s in a ring against
    # 3.91 / 4.00 s through the channel, 0.73x TP=1's (docs/performance.md, "Two GPUs").
    pipeline_handoff: Literal["auto", "channel", "p2p", "ring"] = "auto"
    distributed: Literal["local", "ray"] = "local"
    placement_strategy: str = "STRICT_PACK"
    placement_timeout_s: float = 60.0
    async_scheduling: bool | None = None
    # Steps in flight with async scheduling (one pipeline stage): 2 queues step k+1 behind step k; 3 queues k+2 too, so
    # that the host's round trip between a step's end and the launch of the one after next (the workers' reply, the
    # scheduler, the step's transport and the workers' launch) has two steps of device time instead of one. A TP=2
    # decode step is half a TP=1 one while that round trip is not. A stop token is then found two steps late. None: 3
    # through Ray, where that round trip crosses processes (on 2xH200 at TP=2, with the Lamport sums, the decode-heavy
    # workload took 9.91 s against 11.76 s at depth 2 with torch's one-shot sums, 0.997x vLLM's), 2 in-process (no
    # change at TP=1 on the H100: docs/performance.md).
    async_depth: int | None = None
    # The same request gives the same tokens whatever else is in the batch, however its prompt is chunked, preempted
    # or not: batch-invariant matmuls, attention ("invariant") and all-reduce (docs/deterministic.md).
    deterministic: bool = False
    # False: TP on GPUs sums decode steps' partial results through peer memory, one kernel each
    # (worker/peer_all_reduce.py), the TP workers of a node each seeing all of that node's TP GPUs, as vLLM's Ray
    # workers do; True: NCCL for every sum (vLLM's spelling and default). On 2xH200, W1 at TP=2 in one call took
    # 3.23 / 3.22 s with peer memory against 3.43 / 3.24 s on NCCL, decode steps 6.97 / 6.96 ms against 7.75 / 7.11
    # (docs/performance.md, "Two GPUs").
    disable_custom_all_reduce: bool = False
    # > 0: with TP, a row-parallel product of at least this many rows (a prefill chunk) runs in two halves, the first
    # half's sum on NCCL while the second half is computed (``TPGroup.overlap_rows``); 0: one product, then its sum.
    # Off: W1 at TP=2 on 2xH200 was within noise with it (bench/throughput.py ``/overlap``, docs/performance.md).
    tp_overlap_rows: int = 0


@dataclass(frozen=True)
class EnginePlan:
    """What ``plan`` derived: one ``WorkerConfig`` per worker (pp-major), and the ledger's shape."""

    config: EngineConfig
    model: ModelConfig
    device: str
    dtype: torch.dtype
    attention: str
    max_model_len: int
    workers: tuple[WorkerConfig, ...]
    scheduler: SchedulerConfig
    ledger_spec: KVCacheSpec
    num_pages: int  # 0 until ``sized`` where the pools are a fraction of the workers' free memory
    async_scheduling: bool = False  # schedule and queue step k+1 while step k runs (see ``cluster.engine_core``)
    async_depth: int = 2  # steps in flight with async scheduling (``EngineConfig.async_depth``, its None resolved)
    # How pipeline stages hand on hidden states: "channel", "p2p" or "ring" (``EngineConfig.pipeline_handoff``, its
    # "auto" resolved; "ring" only where it runs, else "p2p")
    pipeline_handoff: str = "channel"

    @property
    def steps_in_flight(self) -> int:
        """The most steps the engine keeps in flight: ``async_depth`` with async scheduling, the micro-batches with
        pipeline parallelism (one a stage unless ``pipeline_micro_batches`` says otherwise) and one more in a token ring
        (a micro-batch's next step queued behind the step whose tokens it takes), else one."""
        if self.async_scheduling:
            return self.async_depth
        return self.scheduler.micro_batches + bool(self.scheduler.token_ring)

    @property
    def is_sized(self) -> bool:
        return all(w.pool_bytes is not None for w in self.workers)

    def sized(self, budgets: list[int]) -> EnginePlan:
        """This plan with every worker's pool sized to the same page count, the most that each worker's KV
        memory ``budgets`` (plan order, measured once its weights were loaded) holds, never more than the slots of
        every request that may run at once (and the graphs' scratch slot) would map, all full."""
        running = self.config.max_num_seqs + (1 if self.cuda_graphs else 0)
        full = min(running * w.kv_spec.pages_for(w.kv_spec.max_tokens) for w in self.workers)
        fits = _pages_within(self.workers, budgets)
        if min(fits) <= 0:
            w = fits.index(min(fits))
            share = (f"gpu_memory_utilization={self.config.gpu_memory_utilization}" if self.config.kv_memory_fraction is None
                     else f"kv_memory_fraction={self.config.kv_memory_fraction}")
            raise ValueError(f"{share} leaves {budgets[w]} bytes of KV memory "
                             f"on the tightest worker: no KV page of {_slot_page_bytes(self.workers[w])} bytes fits")
        return self.with_pages(min(min(fits), full))

    def with_pages(self, pages: int) -> EnginePlan:
        """This plan with pools of ``pages`` slot pages on every worker."""
        workers = tuple(replace(w, pool_bytes=pages * _slot_page_bytes(w)) for w in self.workers)
        return replace(self, workers=workers, num_pages=pages)

    @property
    def cuda_graphs(self) -> bool:
        return self.workers[0].graph_batch > 0

    @property
    def slot_pages(self) -> int:
        """Pages one request's slot can ever get: the pool, less the CUDA graphs' scratch page."""
        return self.num_pages - (1 if self.cuda_graphs else 0)

    def new_ledger(self) -> PageLedger:
        """A fresh ledger (and the CUDA graphs' scratch slot in it, recorded for the workers)."""
        keeps = self.ledger_spec.layout != "paged" and self.config.deferred_reclamation
        ledger = PageLedger(self.ledger_spec, self.num_pages, keeps_pages_on_free=keeps,
                            caches_prefixes=self.config.enable_prefix_caching)
        if self.cuda_graphs:
            scratch = ledger.alloc_slot(1)
            ledger.ensure(scratch, 1)
            if scratch != self.workers[0].scratch_slot:
                raise AssertionError(f"the graphs' scratch slot is {scratch}, the workers expect {self.workers[0].scratch_slot}")
        return ledger


#: ``EngineConfig.mixed_graph_tokens``' default on one GPU: a 512-token prompt beside 1,500 decode rows.
MIXED_GRAPH_TOKENS = 2048


def _fastest(layout: str, head_dim: int) -> str:
    """FlashAttention-3's steps with flash-attn's decode over a virtual cache where both import (W1 on the H100
    1.4% and long contexts 2% faster than FlashInfer's prefill, bench/results/peer_fa3_h100.json), else
    FlashInfer's prefill with flash-attn's decode where both packages import and FlashInfer has kernels for
    the head size (W1 on the H100: 1.04-1.05x flash-attn alone, bench/results/w1_flashinfer_h100.json), else
    flash-attn's kernels (1.08x torch's FA2, w1_flash_attn_fused_h100.json), else torch's FA2 (a paged layout:
    gather + FA2); saying what is missing."""
    paged = layout == "paged"
    try:
        importlib.import_module("flash_attn")  # imports, not just found: a broken build falls back too
    except Exception as exc:
        fallback = "paged" if paged else "fa2"
        logger.warning("flash-attn does not import (%s): attention runs on torch's FlashAttention-2 (%s), slower "
                       "(tools/build_flash_attn.py builds flash-attn's kernels)", exc, fallback)
        return fallback
    # Head dims up to 128: what tools/build_fa3.py builds by default and the H100 measured (a full FA3 build has
    # more; --attention fa3 takes them).
    if not paged and head_dim <= 128 and importlib.util.find_spec("flash_attn_interface") is not None:
        try:
            importlib.import_module("flash_attn_interface")
            return "fa3"
        except Exception as exc:
            logger.warning("FlashAttention-3 is installed but does not import (%s): prefill runs on FlashInfer's "
                           "kernel or flash-attn's", exc)
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return "flash_attn_paged" if paged else "flash_attn"
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:
        fallback = "flash_attn_paged" if paged else "flash_attn"
        logger.warning("flashinfer does not import (%s): prefill runs on flash-attn's FA2 kernels (%s), slower "
                       "(`pip install flashinfer-python`)", exc, fallback)
        return fallback
    return "flashinfer_paged" if paged else "flashinfer"


def _slot_page_bytes(worker: WorkerConfig) -> int:
    """One slot page of this worker: a page (a block, for ``paged``) in each of its buffers."""
    return worker.kv_spec.page_bytes * worker.kv_spec.num_buffers


def _pages_within(workers, budgets: list[int]) -> list[int]:
    """The slot pages each worker's budget holds."""
    return [b // _slot_page_bytes(w) for w, b in zip(workers, budgets, strict=True)]


def parse_size(text: str | int) -> int:
    """Bytes from ``"512MiB"``, ``"20GiB"``, ``"4KiB"``, ``"1.5g"`` or a plain number."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    clean = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if clean and clean[-1] in units:
            return int(float(clean[:-1]) * units[clean[-1]])
        return int(clean)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 512MiB, 20GiB, 4096)") from None


def model_config(model: str) -> ModelConfig:
    """A preset's or a model directory's shape, without loading weights."""
    if model in PRESETS:
        return PRESETS[model]
    if not Path(model).is_dir():
        raise FileNotFoundError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    return ModelConfig.from_hf(model)


def split_layers(num_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, the earlier stages one layer longer where it does not divide."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {stages!r}")
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} is larger than the model's {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    starts = [s * base + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def plan(config: EngineConfig, model: ModelConfig, device: str) -> EnginePlan:
    """Check ``config`` against ``model`` and lay out the workers; every error names the numbers."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    for what, n in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads)):
        if n % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {what}={n}")
    ranges = split_layers(model.num_layers, pp)
    if config.distributed not in ("local", "ray"):
        raise ValueError(f"distributed must be 'local' or 'ray', got {config.distributed!r}")
    if config.distributed == "local" and tp * pp > 1:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs distributed='ray'")
    # Checked before any worker starts (a bad value must not leave actors behind).
    max_model_len = min(config.max_model_len or model.max_context, model.max_context)
    # In-process too: step k+1 is queued on the device behind step k (W1 on the H100: 1.40-1.46x the floor against
    # 1.47-1.59x one step at a time, bench/results/w1_launch_ahead*_h100.json). With pipeline stages the steps in flight
    # are micro-batches of other sequences instead: the first stage would need the last stage's samples to continue
    # the same ones.
    ahead = config.async_scheduling if config.async_scheduling is not None else True
    if not isinstance(ahead, bool):
        raise ValueError(f"async_scheduling must be a bool or None, got {config.async_scheduling!r}")
    depth = config.async_depth if config.async_depth is not None else 3 if config.distributed == "ray" else 2
    if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= 4:
        raise ValueError(f"async_depth must be None or an int in [2, 4] (steps in flight with async scheduling), got "
                         f"{config.async_depth!r}")
    micro = config.pipeline_micro_batches
    if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1 or pp == 1):
        raise ValueError(f"pipeline_micro_batches must be None or an int >= 1 with pipeline_parallel_size > 1, got "
                         f"{micro!r} with pipeline_parallel_size={pp}")
    handoff = config.pipeline_handoff
    if handoff not in ("auto", "channel", "p2p", "ring"):
        raise ValueError(f"pipeline_handoff must be 'auto', 'channel', 'p2p' or 'ring', got {handoff!r}")
    if handoff == "auto":
        handoff = "ring" if pp > 1 and ahead and micro in (None, pp) else "channel"
    # The first stage receives the tokens of the step launched as many steps before as there are stages: the
    # sequences must come round at that pace, a micro-batch a stage.
    ring = pp if handoff == "ring" and pp > 1 and ahead else 0
    if handoff == "ring" and not ring:
        handoff = "p2p"  # one stage, or one step at a time: nothing comes round
    if ring and micro not in (None, pp):
        raise ValueError(f"pipeline_handoff='ring' runs a micro-batch a stage: pipeline_micro_batches must be None or "
                         f"{pp}, got {micro!r}")
    scheduler = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode, config.swap_space,
                                max_model_len, config.map_ahead, micro_batches=(micro or pp) if ahead else 1,
                                token_ring=ring, eager_slots=config.eager_slots,
                                fused_prefix_pages=config.fused_prefix_pages)
    overlap = ahead and pp == 1  # one stage: the next step continues the same sequences, on placeholders
    if config.placement_strategy not in STRATEGIES:
        raise ValueError(f"placement_strategy must be one of {STRATEGIES}, got {config.placement_strategy!r}")
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {config.dtype!r}")
    layout = config.kv_layout
    # FlashAttention's kernels take 16-bit floats only: a float32 engine defaults to the reference attention.
    flash_dtype = dtype_name in ("bfloat16", "float16")
    if not isinstance(config.deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {config.deterministic!r}")
    if config.deterministic and config.attention not in (None, "invariant"):
        raise ValueError(f"deterministic=True runs the batch-invariant attention ('invariant'); attention="
                         f"{config.attention!r} sums in an order that depends on the batch")
    if config.deterministic:
        attention = "invariant"
    else:
        attention = config.attention or (_fastest(layout, model.head_dim) if device == "cuda" and flash_dtype else "torch")
    if attention == "invariant" and device == "cuda" and layout == "paged":
        raise ValueError("attention 'invariant' reads a virtual KV layout (mega/per_layer) on CUDA, got kv_layout='paged'")
    if attention in IN_PLACE and (layout == "paged" or device != "cuda"):
        raise ValueError(f"attention {attention!r} needs a virtual KV layout (mega/per_layer) on CUDA")
    if attention in PAGED_KERNELS and (layout != "paged" or device != "cuda"):
        raise ValueError(f"attention {attention!r} needs the paged KV layout on CUDA")
    # kernels that read the cache where it is (their reads fit a CUDA graph)
    in_place = (*IN_PLACE, *PAGED_KERNELS, *(("invariant",) if device == "cuda" else ()))
    if attention.startswith("flashinfer") and model.head_dim not in FLASHINFER_HEAD_DIMS:
        raise ValueError(f"attention {attention!r} has kernels for head_dim {' / '.join(map(str, FLASHINFER_HEAD_DIMS))}, "
                         f"got {model.head_dim}")
    if attention in (*IN_PLACE, *PAGED_KERNELS) and model.head_dim % 8:
        # FlashAttention pads such heads, and padding a K/V cache copies all of it, unmapped pages too.
        raise ValueError(f"attention {attention!r} needs head_dim a multiple of 8, got {model.head_dim}")
    if device == "cuda" and (attention in (*IN_PLACE, *PAGED_KERNELS) or attention == "paged") and not flash_dtype:
        raise ValueError(f"attention {attention!r} runs FlashAttention kernels, which take float16 or bfloat16: got "
                         f"dtype={dtype_name!r} (attention='torch' runs float32)")
    for name in ("map_ahead", "deferred_reclamation", "enable_prefix_caching", "zero_unmapped", "disable_custom_all_reduce"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(config, name)!r}")
    if isinstance(config.eager_slots, bool) or not isinstance(config.eager_slots, int) or config.eager_slots < 0:
        raise ValueError(f"eager_slots must be an int >= 0 (0: off), got {config.eager_slots!r}")
    mixed = config.mixed_graph_tokens
    if mixed is not None and (isinstance(mixed, bool) or not isinstance(mixed, int) or mixed < 0):
        raise ValueError(f"mixed_graph_tokens must be None or an int >= 0 (0: off), got {mixed!r}")
    rows = config.tp_overlap_rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"tp_overlap_rows must be an int >= 0 (0: off), got {rows!r}")
    guard = config.kv_guard_tokens
    if guard is not None and (isinstance(guard, bool) or not isinstance(guard, int) or guard < 1):
        raise ValueError(f"kv_guard_tokens must be None or an int >= 1, got {guard!r}")
    block_size = config.block_size if config.block_size is not None else 256 if attention in PAGED_KERNELS else 16
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 (tokens a block of the paged layout), got {block_size!r}")
    if attention in PAGED_KERNELS and block_size % 256:
        raise ValueError(f"attention {attention!r} reads blocks of a multiple of 256 tokens, got block_size={block_size}")
    # With tensor parallelism each rank captures its shard's graphs, the all-reduces inside them (NCCL collectives
    # are capturable), and the ranks replay the same batch size in lock-step, as they run every step. A pipeline
    # stage captures its own layers, the hand-off between stages outside them (W1 at PP=2 on 2xH200: 3.48 s in
    # graphs, 6.51 s eager; docs/performance.md, "Two GPUs").
    graphs = config.cuda_graphs if config.cuda_graphs is not None else attention in in_place
    if graphs and attention not in in_place:
        raise ValueError(f"cuda_graphs need an attention backend that reads the cache in place {in_place}, got {attention!r}")
    # CUDA graphs hold one slot as scratch for padded rows. A virtual layout's freed slot keeps its pages, and the steps
    # in flight may still read it: a request that reuses it at once, where it must let go of pages (those the prefix
    # cache holds), waits for those steps in its own step's launch -- at every new request where max_num_seqs run, with
    # no other slot free (GPU serving at 256 clients). Spare slots let a freed slot rest; a slot is address space only.
    spare = 0 if layout == "paged" else max(8, config.max_num_seqs // 8)
    slots = config.max_num_seqs + spare + (1 if graphs else 0)
    page = block_size if layout == "paged" else config.page_size  # tokens per block, or bytes per page
    # Mega pages span a stage's layers: pad every stage to the longest so that all share tokens per page.
    layers = max(len(r) for r in ranges)
    dtype = DTYPES[dtype_name]
    specs = [KVCacheSpec(layers if layout == "mega" else len(r), model.num_kv_heads // tp, model.head_dim, dtype,
                         slots, max_model_len, layout, page) for r in ranges]
    for name in ("kv_memory_fraction", "gpu_memory_utilization"):
        share = getattr(config, name)
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ValueError(f"{name} must be a number in (0, 1], got {share!r}")
    if config.gpu_memory_utilization is not None and config.kv_memory_fraction is not None:
        raise ValueError(f"set kv_memory_fraction ({config.kv_memory_fraction}) or gpu_memory_utilization "
                         f"({config.gpu_memory_utilization}), not both")
    if config.gpu_memory_utilization is not None and device != "cuda":
        raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} sizes the KV pool by GPU memory; "
                         f"device is {device!r} (set kv_memory or kv_memory_fraction)")
    if mixed is None:
        mixed = MIXED_GRAPH_TOKENS if tp == pp == 1 else 0
    workers = tuple(
        WorkerConfig(config.model, dtype, device, specs[p], None, attention, ranges[p], p, t, tp,
                     scheduler.step_seqs if graphs else 0, 0 if graphs else None, swap=config.preemption_mode == "swap",
                     deferred_reclamation=config.deferred_reclamation, zero_unmapped=config.zero_unmapped,
                     kv_guard_tokens=config.kv_guard_tokens if config.zero_unmapped else None,
                     seed=config.seed, progress=config.progress,
                     load_format=config.load_format, fills_placeholders=overlap, token_ring=bool(ring),
                     deterministic=config.deterministic,
                     custom_all_reduce=not config.disable_custom_all_reduce, tp_overlap_rows=config.tp_overlap_rows,
                     warm_rows=0 if config.deterministic else config.max_num_batched_tokens,  # its own matmuls
                     mixed_graph_tokens=min(mixed, config.max_num_batched_tokens) if graphs else 0)
        for p in range(pp) for t in range(tp)
    )
    ledger_spec = specs[max(range(pp), key=lambda p: specs[p].bytes_per_token)]
    unsized = EnginePlan(config, model, device, dtype, attention, max_model_len, workers, scheduler, ledger_spec, 0,
                         overlap, depth, handoff)
    if config.kv_memory_fraction is not None or config.gpu_memory_utilization is not None:
        return unsized  # the executor sizes it once the workers' weights are in (``EnginePlan.sized``)
    pages = min(_pages_within(workers, [config.kv_memory] * len(workers)))
    if pages <= 0:
        raise ValueError(f"kv_memory={config.kv_memory} bytes holds no KV page of {max(map(_slot_page_bytes, workers))} bytes")
    return unsized.with_pages(pages)

