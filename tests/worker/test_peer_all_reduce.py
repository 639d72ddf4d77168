"""The peer-memory all-reduce on two GPUs (two processes, NCCL beside it), torch's one-shot kernel and our Lamport
kernel: the same sums as NCCL's, eagerly and replayed from a CUDA graph, and NCCL for what it does not take; whether
processes that see one GPU each (as Ray lends them) can share peer memory at all; a step of the connection failing on
one rank only; the ranks' agreement on a failure, over gloo, not waiting for the device; and the greedy pick of an LM
head split by vocabulary, over NCCL."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import cuda_missing
from worker.kernels import rms_norm
from worker.parallel import TPGroup
from worker.peer_all_reduce import PeerAllReduce

pytestmark = pytest.mark.gpu


def _join(rank: int, init: str, isolated: bool) -> torch.device:
    """This process's GPU, in a group of two over NCCL; ``isolated``: it sees its own GPU only, as Ray lends one
    (set before CUDA starts here)."""
    if isolated:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = torch.device("cuda", 0 if isolated else rank)
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", init_method=init, rank=rank, world_size=2, device_id=device)
    return device


def _two_ranks(fn, tmp_path, *args) -> list:
    """What ``fn(rank, init, out, *args)`` saved on each of two ranks, one process and GPU each."""
    if cuda_missing():
        pytest.skip(cuda_missing())
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    out = str(tmp_path / "saved")
    ranks = mp.spawn(fn, args=(f"file://{tmp_path}/rendezvous", out, *args), nprocs=2, join=False)
    deadline = time.monotonic() + 240  # a rank left in a collective would hang the suite: fail instead
    while not ranks.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
                process.join()
            pytest.fail(f"{fn.__name__}: a rank hung (240 s)")
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


def _rank(rank: int, init: str, out: str, kernel: str) -> None:
    device = _join(rank, init, isolated=False)
    try:
        nccl = TPGroup(rank, 2)
        peer = PeerAllReduce.connect(nccl, device, kernel=kernel)
        assert peer is not None, "symmetric memory failed on this machine (the warning says why)"
        tp = TPGroup(rank, 2, peer=peer)
        g = torch.Generator(device=device).manual_seed(rank)
        results = {}
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 3, 128, 256, 1024):  # 1024 rows: 8-16 MiB, past the buffer: NCCL's
                x = torch.randn(rows, 4096, generator=g, device=device).to(dtype)
                x[0, :8] = -0.0  # the Lamport kernel's sentinel, which a part may hold
                takes = dtype is torch.bfloat16 or kernel == "one_shot"  # the Lamport kernel adds 16-bit floats only
                assert peer.fits(x) == (takes and rows * 4096 * x.element_size() <= peer.max_bytes)
                results[f"{dtype}-{rows}"] = (tp.all_reduce(x.clone()).cpu(), nccl.all_reduce(x.clone()).cpu())
        # Sums of every size one after another, as a step's layers make them (the Lamport kernel's three buffers
        # in turn, each set back to the sentinel by the call after it)
        for i, rows in enumerate([1, 7, 64, 255, 2, 128, 33] * 3):
            x = torch.randn(rows, 4096, generator=g, device=device).to(torch.bfloat16)
            results[f"sequence-{i}"] = (tp.all_reduce(x.clone()).cpu(), nccl.all_reduce(x.clone()).cpu())
        # The sum with the residual add and RMSNorm after it (one kernel with the Lamport kernel's peer memory), against
        # NCCL's sum and then the norm's kernel: the same bits
        weight = torch.randn(4096, generator=g, device=device).to(torch.bfloat16)
        for rows in (1, 64, 256, 1024):  # 1024 rows: past the buffer, the sum on NCCL then the norm
            x = torch.randn(rows, 4096, generator=g, device=device).to(torch.bfloat16)
            residual = torch.randn(rows, 4096, generator=g, device=device).to(torch.bfloat16)
            assert peer.fuses(x, residual) == (kernel == "lamport" and rows <= 256)
            got = torch.cat(tp.add_norm(x.clone(), residual, weight, 1e-5))
            want = torch.cat(rms_norm(nccl.all_reduce(x.clone()), weight, 1e-5, residual))
            results[f"norm-{rows}"] = (got.cpu(), want.cpu())
        # A view 8 bytes off a 16-byte boundary: summed through an aligned copy, written back into the view.
        base = torch.randn(64 * 4096 + 4, generator=g, device=device).to(torch.bfloat16)
        view = base[4:].view(64, 4096)
        assert peer.fits(view) and view.data_ptr() % 16
        want = nccl.all_reduce(view.clone()).cpu()
        results["misaligned"] = (tp.all_reduce(view).cpu(), want)
        # In a graph: the copy into the shared buffer, the barrier and the peer reads replay with new inputs.
        static = torch.zeros(64, 4096, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            tp.all_reduce(static.clone())  # warm-up outside the graph
        torch.cuda.current_stream(device).wait_stream(stream)
        tp.barrier(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            summed = tp.all_reduce(static * 1)
        for i in range(3):
            x = torch.randn(64, 4096, generator=g, device=device).to(torch.bfloat16)
            static.copy_(x)
            graph.replay()
            results[f"graph-{i}"] = (summed.cpu(), nccl.all_reduce(x.clone()).cpu())
            y = torch.randn(16, 4096, generator=g, device=device).to(torch.bfloat16)  # an eager sum between replays
            results[f"between-{i}"] = (tp.all_reduce(y.clone()).cpu(), nccl.all_reduce(y.clone()).cpu())
        torch.cuda.synchronize(device)
        del graph
        torch.save(results, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("kernel", ["one_shot", "lamport"])
def test_peer_sums_are_nccls_eager_and_in_a_graph(tmp_path, kernel):
    for results in _two_ranks(_rank, tmp_path, kernel):
        assert len(results) == 42
        for name, (peer, nccl) in results.items():
            assert torch.equal(peer, nccl), name  # two ranks: a + b, rounded once, whoever adds


def _isolated_rank(rank: int, init: str, out: str) -> None:
    device = _join(rank, init, isolated=True)
    try:
        peer = PeerAllReduce.connect(TPGroup(rank, 2), device)
        torch.save(peer is not None, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_that_see_one_gpu_each_agree_whether_peer_memory_works(tmp_path):
    # Whichever way it goes on this machine (Ray's workers see every GPU of their node's ranks, so that it works),
    # every rank comes back with the same answer and none hangs.
    answers = _two_ranks(_isolated_rank, tmp_path)
    assert answers[0] == answers[1]
    print(f"peer memory between processes that see one GPU each: {'works' if answers[0] else 'fails'}")


def _one_failing_rank(rank: int, init: str, out: str, kernel: str, where: str) -> None:
    device = _join(rank, init, isolated=False)
    try:
        import worker.peer_all_reduce as peer_all_reduce

        original = getattr(peer_all_reduce, where)
        if rank == 1:  # this rank's step fails, as an allocation or a rank's own check after a collective can
            def fail(*args):
                if where != "_allocate":  # the step's collectives run; this rank's check after them fails
                    original(*args)
                raise RuntimeError(f"rank 1's {where} failed")

            setattr(peer_all_reduce, where, fail)
        answers = [PeerAllReduce.connect(TPGroup(rank, 2), device, kernel=kernel) is not None]
        setattr(peer_all_reduce, where, original)
        if where == "_allocate":  # no collective ran: the group connects again as if nothing had happened
            answers.append(PeerAllReduce.connect(TPGroup(rank, 2), device, kernel=kernel) is not None)
        torch.save(answers, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("where", ["_allocate", "_exchange", "_probe"])
@pytest.mark.parametrize("kernel", ["one_shot", "lamport"])
def test_a_step_that_fails_on_one_rank_sends_every_rank_to_nccl_and_none_hangs(tmp_path, kernel, where):
    # Each step of the connection ends in an agreement: rank 0 does not wait in the next step's collective for a rank
    # that failed before it (before, a failed check after the exchange left rank 0 in the barrier).
    want = [False, True] if where == "_allocate" else [False]
    assert _two_ranks(_one_failing_rank, tmp_path, kernel, where) == [want, want]


def _agreeing_rank(rank: int, init: str, out: str) -> None:
    device = _join(rank, init, isolated=False)
    try:
        hosts = torch.distributed.new_group([0, 1], backend="gloo")
        timings = {}
        for name, tp in (("gloo", TPGroup(rank, 2, cpu_group=hosts)), ("nccl", TPGroup(rank, 2))):
            tp.barrier(device)
            torch.cuda._sleep(2_000_000_000)  # ~1 s of device work queued, as a step in flight is
            start = time.perf_counter()
            nobody = tp.failed_rank(False, device)
            timings[name] = (time.perf_counter() - start, nobody, tp.failed_rank(rank == 1, device))
        torch.cuda.synchronize(device)
        torch.save(timings, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_the_ranks_agree_on_a_failure_without_waiting_for_the_device(tmp_path):
    # Every TP rank asks the others before it launches a step; over NCCL that question queued behind the step in
    # flight, so each launch waited for the device. Over the hosts' gloo group it returns at once.
    for timings in _two_ranks(_agreeing_rank, tmp_path):
        waited, nobody, failed = timings["gloo"]
        assert waited < 0.2 and nobody is None and failed == 1
        waited, nobody, failed = timings["nccl"]
        assert waited > 0.2 and nobody is None and failed == 1  # the old way: behind the queued work


def _pick_rank(rank: int, init: str, out: str) -> None:
    device = _join(rank, init, isolated=False)
    try:
        whole = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        whole[:8] = 1.0  # every column ties: the first
        whole[8:16, 3] = whole[8:16, 600] = 50.0  # a tie across the ranks: rank 0's column
        whole[16:24, 700] = whole[16:24, 900] = 50.0  # a tie within rank 1's half
        half = whole.chunk(2, dim=-1)[rank].contiguous().to(device)
        torch.save((TPGroup(rank, 2).argmax_columns(half).cpu(), whole.float().argmax(-1)), f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_a_split_lm_heads_greedy_pick_over_nccl_is_the_whole_rows_argmax(tmp_path):
    """``TPGroup.argmax_columns`` on the GPUs (CUDA's max and NCCL's gather): each rank's half of the vocabulary gives
    the whole row's argmax on both ranks, ties included (the first of the highest, as the whole row's)."""
    for picked, want in _two_ranks(_pick_rank, tmp_path):
        assert torch.equal(picked, want)
