"""``WorkerActor``: one ``Worker`` (a TP rank of a PP stage) in its own Ray actor process, driven by the
scheduler actor's ``RayExecutor``."""

from __future__ import annotations

import os
from dataclasses import replace

import ray
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from cluster.stage_link import StageLink
from kvmem.stats import PageMap, SlotAccounting
from worker.heap import freeze_heap
from worker.messages import StepInput, WorkerOutput
from worker.worker import Worker, WorkerConfig


@ray.remote
class WorkerActor:
    """One shard on its own process (and GPU). Methods ``execute`` / ``report`` are the compiled graph's."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.worker: Worker | None = None
        # (TP group, its gloo twin, the token ring's) once joined; None: not distributed
        self._groups: tuple | None = None
        self._link: StageLink | None = None
        self._rendezvous: dist.TCPStore | None = None  # rank 0's, from ``address`` on
        # This worker's CUDA device where it sees more than its own GPU: selected again in every call (``_select_device``)
        self._device: int | None = None

    def address(self) -> str:
        """A TCP rendezvous on this actor's node for torch.distributed (rank 0 only): its store listens from now on,
        on a port the kernel chose, until the group is joined over it -- a port found free and let go until then
        could be taken meanwhile (by another engine's rendezvous, a server, Ray)."""
        self._rendezvous = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                         timeout=default_pg_timeout)
        return f"tcp://{ray.util.get_node_ip_address()}:{self._rendezvous.port}"

    def gpu(self) -> tuple[str, str]:
        """This actor's node, and the GPU Ray lent it (the ``CUDA_VISIBLE_DEVICES`` Ray set: one id)."""
        return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def setup(self, init_method: str | None, rank: int, world: int, stage_ranks: list[list[int]],
              node_gpus: tuple[str, ...] = (), link: StageLink | None = None, rings: list[list[int]] = ()) -> None:
        """Join the TP groups (every rank creates every stage's group, in the same order), then build the
        shard: model, cache, mapper. ``node_gpus``: the GPUs of this node's workers, to see them all (``_select``);
        ``link``: the stages hand hidden states on themselves (``StageLink``), not through the compiled graph;
        ``rings``: the ranks of each token ring's group (``StageLink.ring_pairs``)."""
        cfg = self.config
        if cfg.device == "cuda":
            self._device = _select(node_gpus)
        if init_method is not None:
            store = self._rendezvous if rank == 0 else _client_store(init_method)
            self._groups = _join_tp_group(cfg.device, store, rank, world, stage_ranks, cfg.pp_rank, rings)
        group, cpu_group, ring_group = self._groups or (None, None, None)  # set up again: the groups joined before
        self.worker = Worker(cfg, tp_group=group, tp_cpu_group=cpu_group)
        self._link = link
        if link is not None:
            link.ring_group = ring_group
            link.connect(self.worker.device)
        self._hidden_dtype = next(self.worker.model.parameters()).dtype
        # Hidden states for the next stage: NCCL channels take GPU tensors (one reader), shm channels host ones.
        self._hidden_device = self.worker.device if cfg.device == "cuda" and cfg.tp_size == 1 else torch.device("cpu")
        freeze_heap(f"worker pp{cfg.pp_rank} tp{cfg.tp_rank}")

    def _select_device(self) -> None:
        """Ray runs an actor's calls on several threads (the compiled graph's loop holds one of them), and a
        thread's current CUDA device starts as device 0: with more than this worker's GPU visible (``_select``),
        kernels that launch on the current device (Triton's, the graphs' streams) would go to another GPU. With
        its own GPU only, device 0 is it on every thread, and nothing is done."""
        if self._device is not None:
            torch.cuda.set_device(self._device)

    def kv_memory_available(self, fraction: float | None, sharers: int, utilization: float | None = None) -> int:
        self._select_device()
        return self.worker.kv_memory_available(fraction, sharers, utilization)

    def allocate(self, pool_bytes: int) -> None:
        self._select_device()
        self.worker.allocate(pool_bytes)
        self.config = replace(self.config, pool_bytes=pool_bytes)  # a shard set up again is made with its pool
        freeze_heap(f"worker pp{self.config.pp_rank} tp{self.config.tp_rank}, its pool")

    def execute(self, step: StepInput, inputs: torch.Tensor | int | None = None):
        """The step; a stage before the last returns its hidden states for the next one (on its GPU when
        one next-stage reader takes them over NCCL, else in host memory) as soon as its kernels are queued
        (``Worker.pass_on``), or with a ``StageLink`` sends them itself and returns the rows sent (the next stage's
        ``inputs``). With async scheduling (one stage) the worker launches ahead: see ``execute_ahead``."""
        self._select_device()
        if self.config.fills_placeholders:  # async scheduling, which has one pipeline stage
            return self.execute_ahead(step)
        return self._run(step, inputs)

    def _run(self, step: StepInput, inputs: torch.Tensor | int | None):
        link = self._link
        if link is not None:  # before the step's KV operations and plan: NCCL queues it, the host goes on
            inputs = link.receive(step, self.worker.model.config.hidden_size, self._hidden_dtype, self.worker.device)
            if link.takes_back:  # the tokens this step's placeholders take
                self.worker.hand(link.take_back(step))
        if self.worker.model.is_last:
            pending = self.worker.launch(step, inputs)
            if link is not None and link.hands_back and pending.launched is not None and any(step.num_samples):
                link.hand_back(pending.launched.tokens)  # queued behind the draw: the first stage receives it
            out = self.worker.finish(pending)
            return WorkerOutput(out.sampled, self.worker.report(), out.logprobs, out.prompt_logprobs)
        hidden = self.worker.pass_on(step, inputs)  # launched ahead: NCCL sends it after the stage's kernels
        if self._link is not None:
            return self._link.send(step, hidden)
        if hidden is None:  # a step with no batch (operations only): the channel still carries a tensor
            return torch.empty(0, self.worker.model.config.hidden_size, device=self._hidden_device)
        return hidden.to(self._hidden_device)

    def execute_ahead(self, step: StepInput) -> tuple[WorkerOutput, ...]:
        """Queue ``step`` on the device, then finish the step the call before queued: the device runs this one
        while the scheduler takes that one's tokens. The reply carries the results finished now, in order: the
        step before's, and this one's too when it had no batch (nothing was queued) or ran on a CPU."""
        if step.prior_masks is not None and self.worker.in_flight is not None:
            launched = self.worker.in_flight.launched
            if launched is not None and launched.awaits_masks:  # the call before's draw: its masks came with this one
                self.worker.supply_masks(self.worker.in_flight, step.prior_masks)
        before = self.worker.in_flight  # the call before's step
        pending = self.worker.launch(step)
        # On a CPU launching a step computes it: its result goes back now, and the scheduler takes it while this
        # worker computes the next call's step (with the next call's reply, it would wait for that one too).
        done_now = pending.launched is None or (self.worker.device.type == "cpu" and not pending.launched.awaits_masks)
        done = [p for p in (before, pending if done_now else None) if p is not None]
        outputs = []
        for p in done:
            out = self.worker.finish(p)
            outputs.append(WorkerOutput(out.sampled, self.worker.report(), out.logprobs, out.prompt_logprobs, p.step))
        return tuple(outputs)

    def report(self, _hidden: torch.Tensor) -> WorkerOutput:
        return WorkerOutput({}, self.worker.report())

    def start_profile(self, directory: str) -> None:
        self.worker.start_profile(directory)

    def stop_profile(self) -> str:
        return self.worker.stop_profile()

    def accounting(self) -> SlotAccounting:
        self._select_device()
        return self.worker.cache.accounting()

    def page_map(self) -> PageMap:
        self._select_device()
        return self.worker.cache.page_map()

    def close(self) -> None:
        self._select_device()
        if self._link is not None:
            self._link.close()
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._groups is not None:
            _leave_groups()
            self._groups = None


# Module-level on purpose: Ray pickles actor methods by value, and cloudpickle then takes along every
# torch.distributed submodule whose name the method's code mentions (``self.config`` names
# ``torch.distributed.config``, which does not pickle).
def _select(node_gpus: tuple[str, ...]) -> int | None:
    """Make this actor's GPU the current device. With ``node_gpus`` (TP ranks on one node) every one of them is made
    visible first, as vLLM's Ray workers do: the peer-memory all-reduce maps the other ranks' buffers into this
    process; then this GPU's index among them, for every later call to select again. Too late once CUDA has started
    in this process (it then sees Ray's one GPU): that one, and NCCL sums. None where it sees its own GPU only."""
    own = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if own and own in node_gpus and len(set(node_gpus)) == len(node_gpus) > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
        if torch.cuda.device_count() == len(node_gpus):
            torch.cuda.set_device(node_gpus.index(own))
            return node_gpus.index(own)
        os.environ["CUDA_VISIBLE_DEVICES"] = own
    torch.cuda.set_device(0)  # Ray shows this actor its one GPU as device 0
    return None


def _client_store(init_method: str) -> dist.TCPStore:
    """The rendezvous store rank 0 holds at ``init_method`` (``WorkerActor.address``), as a client."""
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=default_pg_timeout)


def _join_tp_group(device: str, store: dist.Store, rank: int, world: int, stage_ranks: list[list[int]], stage: int,
                   rings: list[list[int]] = ()):
    """This stage's TP group (None: the default group, with one stage), the same ranks over gloo, for what the
    hosts agree on (``TPGroup.cpu_group``), and the group of this rank's token ring if it has one; every rank creates
    every group, in the same order, over the rendezvous ``store``."""
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device == "cuda" else {}
    # the prefix torch gives a store it makes from an init_method itself
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world, **kwargs)
    groups = [None] if len(stage_ranks) == 1 else [dist.new_group(ranks) for ranks in stage_ranks]
    cpu_groups = [dist.new_group(ranks, backend="gloo") for ranks in stage_ranks]
    ring = None
    for ranks in rings:
        made = dist.new_group(ranks)
        ring = made if rank in ranks else ring
    return groups[stage], cpu_groups[stage], ring


def _leave_groups() -> None:
    dist.destroy_process_group()
