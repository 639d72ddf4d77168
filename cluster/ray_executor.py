"""RayExecutor: one worker actor per (pp stage, tp rank) in one placement group, stepped through a Ray
compiled graph: the step message goes to every worker over shared-memory channels, each stage's hidden
states go on to the next stage's ranks (NCCL on GPUs), and only reports and sampled tokens come back."""

from __future__ import annotations

import itertools
import os
import uuid
from collections import deque
from dataclasses import dataclass, replace

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.worker_actor import WorkerActor
from cluster.config import EnginePlan
from cluster.stage_link import StageLink
from cluster.errors import PlacementError, WorkerGroupError
from cluster.executor import StepResult
from kvmem.stats import PageMap, SlotAccounting
from worker.messages import StepInput

def _describe(exc: BaseException) -> str:
    """One line: the worker's own exception, or what Ray says happened to the actor (and which one)."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
        return f"{type(cause).__name__}: {cause}"
    lines = str(exc).splitlines()
    name = next((line.strip() for line in lines if line.strip().startswith("name:")), "")
    return f"{type(exc).__name__}: {lines[0] if lines else ''} {name}".strip()


# NVLink multicast (NVLS) breaks on the lent GPU machines; every process of the group keeps it off.
CUDA_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CHANNEL_BUFFERS = 3  # compiled-graph executions in flight at most: the engine's steps in flight and a drain
CHANNEL_BYTES = 256 << 10  # a channel buffer: a step of 8192 prompt tokens pickles to ~60 KB


@dataclass(frozen=True)
class RayPendingStep:
    executor: "RayExecutor"
    step: int
    refs: list

    def result(self) -> StepResult:
        try:
            outs = ray.get(self.refs, timeout=self.executor.step_timeout_s)
        except Exception as exc:  # an actor died, raised, or hung: the group's state is unknown
            raise self.executor.failure(f"step {self.step} failed", exc) from exc
        sampler = outs[self.executor.sampler]
        return StepResult(sampler.sampled, tuple(o.report for o in outs), sampler.logprobs, sampler.prompt_logprobs)


@dataclass(frozen=True)
class AheadPendingStep:
    """A step sent to workers that launch ahead: its result comes back with a later call (``RayExecutor.take``)."""

    executor: "RayExecutor"
    step: int

    def result(self) -> StepResult:
        return self.executor.take(self.step)

    def supply_masks(self, masks: dict[int, bytes | None]) -> None:
        self.executor.prior_masks = masks  # they travel with the next call, drain or step


@dataclass(frozen=True)
class Placement:
    """A placement group someone else owns (a Serve replica's): worker i takes bundle ``first_bundle + i``."""

    group: PlacementGroup
    first_bundle: int = 0


class RayExecutor:
    def __init__(self, plan: EnginePlan, step_timeout_s: float = 600.0, placement: Placement | None = None):
        """``placement``: put the workers in those bundles; else they get a placement group of their own."""
        self.plan = plan
        self.step_timeout_s = step_timeout_s
        self._placement = placement
        self._pg = None
        self._actors: list = []
        self._dag = None
        # With async scheduling the workers launch ahead (``WorkerActor.execute_ahead``): each call's reply
        # carries the results of the steps finished during it, which are those of earlier calls.
        self._ahead = plan.async_scheduling
        self._calls: deque[tuple[int, list]] = deque()  # (step, refs) sent, replies not read yet
        self._results: dict[int, StepResult] = {}
        self._drains = itertools.count(-1, -1)  # drain calls' step numbers: the engine's are >= 0
        # Grammar masks of the step the workers hold, sent with the next call: the sampling worker draws that step
        # before it launches the next (``WorkerActor.execute_ahead``), so no call of its own is needed.
        self.prior_masks: dict[int, bytes | None] | None = None
        self._start()

    @property
    def _p2p(self) -> bool:
        """The pipeline stages hand hidden states on themselves (``pipeline_handoff="p2p"`` or ``"ring"``,
        ``StageLink``); in a ring (``SchedulerConfig.token_ring``) the last stage's drawn tokens go back to the
        first."""
        return self.plan.pipeline_handoff in ("p2p", "ring") and self.plan.config.pipeline_parallel_size > 1

    @property
    def late_masks(self) -> bool:
        """Whether a step's grammar masks may follow its launch: with workers that launch ahead."""
        return self._ahead

    # -- set-up --------------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            self._place()
            self._spawn()
            self._dag = self._compile()
        except BaseException:
            self.close()
            raise

    def _bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.plan.device == "cuda" else {"CPU": 1.0}

    def _place(self) -> None:
        c = self.plan.config
        n, bundle = len(self.plan.workers), self._bundle()
        if self._placement is not None:
            have = len(self._placement.group.bundle_specs) - self._placement.first_bundle
            if have < n:
                raise PlacementError(f"{n} workers need {n} bundles of the given placement group after bundle "
                                     f"{self._placement.first_bundle}; it has {have}")
            self._pg = self._placement.group
            return
        self._pg = placement_group([bundle] * n, strategy=c.placement_strategy, name=f"vattn-workers-{id(self):x}")
        try:
            ray.get(self._pg.ready(), timeout=c.placement_timeout_s)
        except GetTimeoutError:
            raise PlacementError(
                f"{n} workers (tp={c.tensor_parallel_size} x pp={c.pipeline_parallel_size}) of {bundle} each, "
                f"{c.placement_strategy}, could not be placed within {c.placement_timeout_s} s: the cluster has "
                f"{ray.cluster_resources()}, of which {ray.available_resources()} are free"
            ) from None

    def _spawn(self) -> None:
        gpu = self.plan.device == "cuda"
        # The workers run with this process's VATTN_ switches (kernels on or off, which ones), wherever Ray starts them
        switches = {k: v for k, v in os.environ.items() if k.startswith("VATTN_")}
        env_vars = (CUDA_ENV if gpu else {}) | switches
        env = {"env_vars": env_vars} if env_vars else {}
        group = uuid.uuid4().hex[:8]
        for i, config in enumerate(self.plan.workers):
            if not gpu:  # its pool is made once every worker is up (``_check_host_memory`` first)
                config = replace(config, pool_bytes=None)
            first = self._placement.first_bundle if self._placement is not None else 0
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=first + i)
            self._actors.append(WorkerActor.options(
                name=f"vattn-worker-{group}-pp{config.pp_rank}-tp{config.tp_rank}",
                num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy, runtime_env=env,
                max_concurrency=2,  # the compiled graph's loop holds one thread; accounting() gets the other
            ).remote(config))
        tp, world = self.plan.config.tensor_parallel_size, len(self._actors)
        p2p = self._p2p
        init = ray.get(self._actors[0].address.remote()) if tp > 1 or p2p else None
        stages = [list(range(p * tp, (p + 1) * tp)) for p in range(self.plan.config.pipeline_parallel_size)]
        try:
            # TP ranks see every GPU of their node's workers where the peer-memory all-reduce maps its peers' buffers:
            # torch's symmetric memory refuses ranks that each see their GPU as device 0
            # (tests/worker/test_peer_all_reduce.py)
            c = self.plan.config
            peers = gpu and tp > 1 and not c.disable_custom_all_reduce
            gpus = ray.get([a.gpu.remote() for a in self._actors]) if peers else [("", "")] * world
            node_gpus = [tuple(g for n, g in gpus if n == node) for node, _ in gpus]
            pp, ring = c.pipeline_parallel_size, bool(self.plan.scheduler.token_ring)
            rings = StageLink.ring_pairs(tp, pp) if ring else []
            ray.get([a.setup.remote(init, rank, world, stages, node_gpus[rank],
                                    StageLink.between(rank, tp, pp, ring) if p2p else None, rings)
                     for rank, a in enumerate(self._actors)])
            made = gpu and self.plan.is_sized  # a GPU worker given its pool made it as it started
            if not self.plan.is_sized:  # every worker's weights are in: the pools take a share of what is left
                c = self.plan.config
                budgets = ray.get([a.kv_memory_available.remote(c.kv_memory_fraction, world, c.gpu_memory_utilization)
                                   for a in self._actors])
                self.plan = self.plan.sized(budgets)
            if not gpu:
                self._check_host_memory()
            if not made:
                ray.get([a.allocate.remote(w.pool_bytes) for a, w in zip(self._actors, self.plan.workers, strict=True)])
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause if exc.cause is not None else exc  # the worker's own error (bad model, no memory)

    def _check_host_memory(self) -> None:
        """Refuse CPU pools that together pass what their node has free, before any is made. A host pool's pages are
        committed as it is made, and made at once every worker's own check saw the memory none had taken yet: pools
        that fit one by one but not together passed (two of two thirds of it each; Ray's memory monitor then killed
        the workers). A node's single worker is left to its own check."""
        free = ray.get([a.kv_memory_available.remote(1.0, 1) for a in self._actors])
        nodes = [node for node, _ in ray.get([a.gpu.remote() for a in self._actors])]
        for node in dict.fromkeys(nodes):
            mine = [i for i, n in enumerate(nodes) if n == node]
            need, have = sum(self.plan.workers[i].pool_bytes for i in mine), min(free[i] for i in mine)
            if len(mine) > 1 and need > have:
                raise ValueError(f"kv_memory: the KV pools of {len(mine)} workers on one node, "
                                 f"{need / (1 << 30):.2f} GiB together, are more than its cpu memory has free "
                                 f"({have / (1 << 30):.2f} GiB): lower kv_memory, or size the pools with "
                                 f"kv_memory_fraction")

    def _compile(self):
        tp, pp = self.plan.config.tensor_parallel_size, self.plan.config.pipeline_parallel_size
        outputs = []
        with InputNode() as step:
            hidden = None
            for p in range(pp):
                stage = self._actors[p * tp : (p + 1) * tp]
                # One task a stage: Ray's compiled-graph scheduler refuses (an AssertionError while compiling, seen on
                # 2xH200) a task that reads the NCCL-sent hidden states beside another task's output, which a separate
                # prepare(step) -> execute(prepared, hidden) would need to map and plan while the stage before computes.
                nodes = [a.execute.bind(step) if hidden is None else a.execute.bind(step, hidden) for a in stage]
                if p == pp - 1:
                    outputs += nodes
                    break
                if self.plan.device == "cuda" and tp == 1 and not self._p2p:
                    # GPU to GPU over NCCL (measured on 2xH200, PP=2). With several TP readers per stage the
                    # hidden states go through host memory instead: that run (TP=2 x PP=2, 4xH200) hung with
                    # Ray's NCCL channel to two readers beside torch's NCCL TP groups. With ``StageLink`` the
                    # stages send them themselves, and the graph carries only the rows sent.
                    nodes[0] = nodes[0].with_tensor_transport("accelerator")
                outputs += [a.report.bind(node) for a, node in zip(stage, nodes)]
                hidden = nodes[0]  # TP ranks of a stage end equal (all-reduced): rank 0's goes on
            dag = MultiOutputNode(outputs)
        # Ray frees no channel buffer when a graph is torn down (ray-project/ray#43836), and each rebuild after a lost
        # worker compiles a new graph: a channel holds one buffer per execution in flight (Ray's default: 10 of 1 MB),
        # which the engine never needs (its steps in flight and a drain), so a rebuild leaves CHANNEL_BUFFERS x
        # CHANNEL_BYTES a channel behind instead of 10 MB. A larger message grows its channel.
        buffers = max(CHANNEL_BUFFERS, self.plan.steps_in_flight + 1)  # PP > 2: a micro-batch a stage
        return dag.experimental_compile(_submit_timeout=self.step_timeout_s, _max_inflight_executions=buffers,
                                        _buffer_size_bytes=CHANNEL_BYTES)

    # -- steps ---------------------------------------------------------------------------------
    def submit(self, step: StepInput) -> "RayPendingStep | AheadPendingStep":
        if self.prior_masks is not None:
            step, self.prior_masks = replace(step, prior_masks=self.prior_masks), None
        try:
            refs = self._dag.execute(step)
        except Exception as exc:
            raise self.failure(f"step {step.step} could not be sent", exc) from exc
        if not self._ahead:
            return RayPendingStep(self, step.step, refs)
        self._calls.append((step.step, refs))
        return AheadPendingStep(self, step.step)

    def failure(self, what: str, exc: BaseException) -> WorkerGroupError:
        """``what`` went wrong, and why: a closed channel or a timeout only says that some peer is gone, so
        each actor is asked, and the first that is dead names itself (a killed actor's step can fail either way,
        whichever the driver notices first)."""
        if not isinstance(exc, ray.exceptions.RayTaskError):
            for actor in self._actors:
                try:
                    ray.get(actor.__ray_ready__.remote(), timeout=5)
                except ray.exceptions.RayActorError as died:
                    exc = died
                    break
                except GetTimeoutError:
                    continue  # alive, answering slowly: not the one that died
        return WorkerGroupError(f"{what}: {_describe(exc)}")

    @property
    def sampler(self) -> int:
        """Which output is the last stage's TP rank 0's."""
        return len(self.plan.workers) - self.plan.config.tensor_parallel_size

    def take(self, step: int) -> StepResult:
        """``step``'s result, from workers that launch ahead: read the replies in order until one carries it;
        when none sent yet will, send a call without a batch (a drain), which makes the workers finish it."""
        while step not in self._results:
            if not self._calls:
                drain = next(self._drains)
                self.submit(StepInput(drain))
            sent, refs = self._calls.popleft()
            try:
                outs = ray.get(refs, timeout=self.step_timeout_s)
            except Exception as exc:  # an actor died, raised, or hung: the group's state is unknown
                raise self.failure(f"step {sent} failed", exc) from exc
            for i, out in enumerate(outs[self.sampler]):  # every worker finished the same steps in this call
                self._results[out.step] = StepResult(out.sampled, tuple(o[i].report for o in outs), out.logprobs,
                                                     out.prompt_logprobs)
        for drained in [s for s in self._results if s < 0]:
            del self._results[drained]
        return self._results.pop(step)

    def execute(self, step: StepInput) -> StepResult:
        return self.submit(step).result()

    def page_maps(self) -> list[PageMap]:
        """Every worker's page map, in the plan's worker order."""
        return ray.get([a.page_map.remote() for a in self._actors])

    def accounting(self) -> list[SlotAccounting]:
        """Every worker's slot accounting (the workers' threads answer between steps)."""
        return ray.get([a.accounting.remote() for a in self._actors])

    def start_profile(self, directory: str) -> None:
        """Every worker records its steps under torch's profiler, the traces on each worker's host."""
        ray.get([a.start_profile.remote(directory) for a in self._actors])

    def stop_profile(self) -> list[str]:
        return ray.get([a.stop_profile.remote() for a in self._actors])

    # -- lifetime ------------------------------------------------------------------------------
    def rebuild(self) -> None:
        self.close()
        self.prior_masks = None
        self._start()

    def close(self) -> None:
        """Tear the graph down, close every worker (caches unmapped, groups destroyed), kill the actors,
        remove the placement group. Safe on a half-built or broken group."""
        self._calls.clear()  # their replies die with the workers
        self._results.clear()
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:
                pass  # a dead actor's channels are gone already
            self._dag = None
        if self._actors:
            try:
                ray.get([a.close.remote() for a in self._actors], timeout=30)
            except Exception:
                pass  # dead or stuck: killing it below releases its memory with its process
            for a in self._actors:
                ray.kill(a)
            self._actors = []
        if self._pg is not None:
            if self._placement is None:  # a group it was given stays its owner's
                remove_placement_group(self._pg)
            self._pg = None
