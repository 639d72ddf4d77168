"""bench/peer.py, the side-by-side harness against vLLM: its refusal to compare what was not measured together, and
its vattn side end to end on the CPU (vLLM itself runs only on the GPU machine)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import peer  # noqa: E402
import trace_breakdown  # noqa: E402
from peer_spec import PeerMismatch, SideResult, SideSpec, WorkloadRun, check_comparable, digest  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]


def tiny_side(tmp_path: Path, max_num_seqs: int, batched_tokens: int, workload: WorkloadRun, **options) -> SideSpec:
    """A vattn side over the ``tiny`` preset on the CPU, running ``PROMPTS`` (written under ``tmp_path``)."""
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    return SideSpec(call_id="c", engine="vattn", label="vattn", model="tiny",
                    engine_args={"device": "cpu", "dtype": "float32", "max_num_seqs": max_num_seqs,
                                 "max_num_batched_tokens": batched_tokens, "kv_memory": 1 << 24, "max_model_len": 64},
                    workloads=[replace(workload, prompts_file=str(prompts_file))], warmup_tokens=4, **options)


def side(label: str, call_id: str = "call-1", device: str = "H100", prompts=PROMPTS, wall: float = 1.0) -> SideResult:
    r = SideResult(call_id=call_id, engine=label.split("-")[0], label=label, device=device, versions={}, engine_args={})
    r.record("w1", prompts, 4, 0, wall, len(prompts) * 4)
    return r


def test_results_of_one_call_compare_into_ratios():
    headers, rows, ratios = peer.compare([side("vattn", wall=0.9), side("vllm", wall=1.0),
                                          side("vllm-defaults", wall=1.2), side("vattn", wall=1.1)], None)
    assert headers[:4] == ["workload", "vattn s", "vllm s", "vllm-defaults s"]
    assert rows[0][:4] == ["w1", 1.0, 1.0, 1.2]
    assert ratios["w1"]["best_vllm"] == "vllm" and ratios["w1"]["vattn_over_vllm"] == pytest.approx(1.0)


def test_a_call_with_vattn_on_one_gpu_gives_every_other_vattn_side_over_it():
    # issue 26's ratios from the call that measures vLLM: TP=2 and PP=2 over one GPU
    _, _, ratios = peer.compare([side("vattn", wall=0.63), side("vattn-tp1", wall=1.0), side("vattn-pp2", wall=0.75),
                                 side("vllm", wall=0.6)], None)
    assert ratios["w1"]["over_vattn_tp1"] == {"vattn": pytest.approx(0.63), "vattn-pp2": pytest.approx(0.75)}
    assert ratios["w1"]["over_best_vllm"]["vattn-tp1"] == pytest.approx(1 / 0.6)


def test_results_of_different_calls_are_refused():
    with pytest.raises(PeerMismatch, match="comes from call call-2, vattn from call call-1: numbers from different calls"):
        check_comparable([side("vattn"), side("vllm", call_id="call-2")])


def test_results_of_different_prompts_are_refused():
    other = [p[:-1] for p in PROMPTS]
    with pytest.raises(PeerMismatch, match=f"workload w1: vllm ran prompts {digest(other, 4)}, vattn ran "
                                           f"{digest(PROMPTS, 4)}: not the same prompts"):
        check_comparable([side("vattn"), side("vllm", prompts=other)])


def test_results_of_different_devices_and_lone_results_are_refused():
    with pytest.raises(PeerMismatch, match="vllm ran on 'H200', vattn on 'H100'"):
        check_comparable([side("vattn"), side("vllm", device="H200")])
    with pytest.raises(PeerMismatch, match="a comparison needs two results or more, got 1"):
        check_comparable([side("vattn")])


def test_a_floor_of_other_prompts_is_refused():
    floor = {"floors": {"w1": {"total_s": 0.5, "digest": digest(PROMPTS[:2], 4)}}}
    with pytest.raises(PeerMismatch, match="workload w1: the floor was measured on other prompts"):
        peer.compare([side("vattn"), side("vllm")], floor)


def test_a_run_short_of_its_tokens_is_an_error():
    r = SideResult(call_id="c", engine="vllm", label="vllm", device="d", versions={}, engine_args={})
    with pytest.raises(RuntimeError, match="vllm: w1 produced 11 output tokens, expected 12"):
        r.record("w1", PROMPTS, 4, 0, 1.0, 11)


def test_hf_config_describes_the_preset():
    from worker.config import ModelConfig, PRESETS

    for preset in ("llama-3-8b", "qwen2.5-7b"):
        assert ModelConfig.from_hf(peer.hf_config(preset)) == replace(PRESETS[preset], bos_token_id=1, eos_token_ids=(2,))


def test_vattn_side_runs_rounds_and_a_profile_split_into_steps(tmp_path):
    spec = tiny_side(tmp_path, 4, 8, WorkloadRun("w1", "", 5), reps=2, profile="w1",
                     profile_dir=str(tmp_path / "profiles"), profile_tokens=6)
    peer.run_vattn(spec, tmp_path / "result.json")
    result = SideResult.read(tmp_path / "result.json")
    assert [(r["workload"], r["round"], r["output_tokens"]) for r in result.runs] == [("w1", 0, 15), ("w1", 1, 15)]
    assert result.digests == {"w1": digest(PROMPTS, 5)}
    assert result.engine_args["resolved"]["max_num_batched_tokens"] == 8
    names = [s.name for s in trace_breakdown.steps(trace_breakdown.load(Path(result.profile_trace)), "^vattn_step_")]
    # 17 prompt tokens in chunks of at most 8, then decode steps of the three sequences
    assert names[0] == "vattn_step_prefill(8)_decode(0)_seqs(2)"
    assert "vattn_step_prefill(0)_decode(3)_seqs(3)" in names


def test_kernels_are_put_in_categories():
    assert trace_breakdown.category("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "matmul"
    assert trace_breakdown.category("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert trace_breakdown.category("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...gemm...>>") == "attention"
    assert trace_breakdown.category("_rms_norm_kernel") == "norm"
    assert trace_breakdown.category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm"
    assert trace_breakdown.category("triton_poi_fused_cat_index_select_mul_2") == "fused elementwise"
    assert trace_breakdown.category("triton_poi_fused_rms_norm_1") == "norm"
    assert trace_breakdown.category("void vllm::act_and_mul_kernel<silu>") == "activation"
    assert trace_breakdown.category("void vllm::reshape_and_cache_flash_kernel<>") == "kv write"
    assert trace_breakdown.category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all-reduce"
    assert trace_breakdown.category("void c10d::symmetric_memory::one_shot_all_reduce_kernel<bf16>") == "all-reduce"


def synthetic_trace(path: Path, steps: list[tuple[str, float]], kernel_after_us: float,
                    maps: tuple[tuple[str, float, float], ...] = ()) -> str:
    """A Chrome trace of ``steps`` (name, start in us): each launches one 100-us attention kernel
    ``kernel_after_us`` after it starts; ``maps``: the KV mapper's ranges (name, start, duration)."""
    events = [{"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur} for name, ts, dur in maps]
    for i, (name, ts) in enumerate(steps):
        events += [{"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": 50},
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts + 10, "dur": 5,
                    "args": {"correlation": i}},
                   {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": ts + kernel_after_us, "dur": 100,
                    "args": {"correlation": i}}]
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_a_breakdown_per_rank_says_how_late_each_rank_starts_its_decode_steps(tmp_path):
    steps = [("vattn_step_prefill(0)_decode(2)_seqs(2)", 1000.0 * i) for i in range(5)]
    result = SideResult("c", "vattn", "vattn", "H200", {}, {}, profile_traces=[
        synthetic_trace(tmp_path / "rank0.json", steps, 20), synthetic_trace(tmp_path / "rank1.json", steps, 520)])
    out = peer.breakdowns([result], requests=2)
    assert out["vattn"]["decode"]["steps"] == out["vattn rank 1"]["decode"]["steps"] == 4  # the last has no end
    assert out["vattn"]["decode"]["by_category_ms"] == {"attention": 0.1}
    assert out["vattn rank 1"]["decode_start_after_rank0_ms"] == pytest.approx(0.5)
    assert "decode_start_after_rank0_ms" not in out["vattn"]
    assert peer.describe(out) == [
        "vattn decode step (4): kernels 0.10 ms, device span 1.00 ms, host 0.05 ms: attention 0.10",
        "vattn rank 1 decode step (4): kernels 0.10 ms, device span 1.00 ms, host 0.05 ms, starting 0.50 ms after "
        "rank 0's: attention 0.10"]


def test_a_breakdown_says_how_long_the_kv_mapper_ran_beside_each_step_and_the_launch_s_parts_took(tmp_path):
    steps = [("vattn_step_prefill(0)_decode(2)_seqs(2)", 1000.0 * i) for i in range(5)]
    # mapping from 20 us to 80 us: 30 us inside step 0's host range (0-50 us), none in step 1's; step 1 waited 20 us
    maps = (("kvmem_map_ahead", 20.0, 60.0), ("kvmem_map_wait", 1010.0, 20.0), ("vattn_phase_kv_ops", 1005.0, 8.0),
            ("vattn_phase_kv_ops", 2005.0, 4.0), ("vattn_phase_plan", 2010.0, 4.0))
    result = SideResult("c", "vattn", "vattn", "H200", {}, {}, profile_traces=[
        synthetic_trace(tmp_path / "rank0.json", steps, 20, maps)])
    decode = peer.breakdowns([result], requests=2)["vattn"]["decode"]
    assert (decode["map_ahead_ms"], decode["map_wait_ms"]) == (pytest.approx(0.030 / 4), pytest.approx(0.020 / 4))
    assert decode["phases_ms"] == {"kv_ops": pytest.approx(0.012 / 4), "plan": pytest.approx(0.004 / 4)}
    assert peer.describe({"vattn": {"prefill": {}, "decode": decode}}) == [
        "vattn decode step (4): kernels 0.10 ms, device span 1.00 ms, host 0.05 ms (mapping beside it 0.01 ms, waited "
        "for 0.01 ms): attention 0.10; host: kv_ops 0.00  plan 0.00"]


def test_a_serving_timeline_tells_decode_steps_from_prefilling_ones_in_both_engines_names(tmp_path):
    """Steps 1 ms apart, each with a 100-us kernel 20 us in, the prefilling step's 100 us later still: the device spans
    1.0, 1.1 and 0.9 ms, idle 0.9, 1.0 and 0.8 of them; the last step has no end, the one before it no next kernel."""
    for decode, prefill in (("execute_context_0(0)_generation_4(4)", "execute_context_1(512)_generation_3(3)"),
                            ("vattn_step_prefill(0)_decode(4)_seqs(4)", "vattn_step_prefill(512)_decode(3)_seqs(4)")):
        names = [decode, decode, prefill, decode, decode]
        path = Path(synthetic_trace(tmp_path / "t.json", [(n, 1000.0 * i) for i, n in enumerate(names)], 20))
        events = trace_breakdown.load(path)
        for e in events:
            if e.get("cat") == "kernel" and e["args"]["correlation"] == 2:
                e["ts"] += 100
        timeline = trace_breakdown.timeline(trace_breakdown.steps(events, r"^(execute_context_|vattn_step_)"))
        assert timeline["steps"] == 4
        assert timeline["device_idle_share"] == pytest.approx(2.7 / 3.0)
        assert timeline["device_idle_between_steps_ms"]["max"] == pytest.approx(1.0)
        assert timeline["decode"]["kernel_ms"]["n"] == 3 and timeline["prefilling"]["kernel_ms"]["n"] == 1
        assert timeline["decode"]["device_span_ms"]["max"] == pytest.approx(1.1)
        assert timeline["prefilling"]["device_span_ms"]["p50"] == pytest.approx(0.9)


def test_sides_run_in_abba_order_with_the_same_settings_and_prompts(tmp_path):
    args = peer.build_parser().parse_args(["run", "--workloads", "w1", "long", "--profile", "w1"])
    specs = peer.prepare(args, "call-1", tmp_path)
    w1 = specs["llama-3-8b 40 GiB"]
    assert [s.label for s in w1] == ["vattn", "vllm", "vllm-defaults", "vllm-defaults", "vllm", "vattn",
                                     "vattn-profile", "vllm-profile"]
    vattn, vllm, defaults = w1[:3]
    shared = {"max_num_seqs": 128, "max_num_batched_tokens": 8192, "max_model_len": 2048 + 128}
    assert vattn.engine_args == shared | {"kv_memory": 40 << 30, "device": "cuda", "dtype": "bfloat16"}
    assert vllm.engine_args == shared | {"kv_cache_memory_bytes": 40 << 30} and defaults.engine_args == {}
    assert vattn.workloads == vllm.workloads and w1[-1].profile == "w1" and w1[-1].reps == 0
    assert json.loads((Path(vllm.model) / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    long = specs["qwen2.5-7b 40 GiB"]
    assert [s.profile for s in long] == [None] * 6 and long[0].engine_args["max_model_len"] == 32000 + 128
    prompts = long[0].workloads[0].prompts()
    assert len(prompts) == 16 and all(8192 <= len(p) <= 32000 for p in prompts)


def test_tensor_parallel_sides_give_both_engines_the_shape_and_run_vattn_on_ray(tmp_path):
    specs = peer.prepare(peer.build_parser().parse_args(["run", "--tp", "2", "--workloads", "w1"]), "call-1", tmp_path)
    vattn, vllm, defaults = specs["llama-3-8b 40 GiB"][:3]
    assert vattn.engine_args["tensor_parallel_size"] == 2 and vattn.engine_args["distributed"] == "ray"
    assert vllm.engine_args["tensor_parallel_size"] == 2 and "distributed" not in vllm.engine_args
    assert defaults.engine_args == {"tensor_parallel_size": 2}
    # vattn on one GPU beside them, through Ray too: the TP=2 / TP=1 ratio from the call that measures vLLM
    one = next(s for s in peer.prepare(peer.build_parser().parse_args(
        ["run", "--tp", "2", "--workloads", "w1", "--sides", "vattn", "vattn-tp1"]), "call-1", tmp_path).values())[1]
    assert one.label == "vattn-tp1" and one.engine_args == vattn.engine_args | {"tensor_parallel_size": 1}
    # and the two GPUs as pipeline stages
    pp = next(s for s in peer.prepare(peer.build_parser().parse_args(
        ["run", "--tp", "2", "--workloads", "w1", "--sides", "vattn-pp2-p2p"]), "call-1", tmp_path).values())[0]
    assert pp.engine_args == vattn.engine_args | {"tensor_parallel_size": 1, "pipeline_parallel_size": 2,
                                                  "pipeline_handoff": "p2p"}


def test_tensor_parallel_runs_refuse_what_only_the_in_process_engine_shows(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["peer.py", "run", "--tp", "2", "--workloads", "w1", "memory"])
    with pytest.raises(SystemExit, match="--tp 2 runs vattn on Ray, whose steps this process cannot see: leave out memory"):
        peer.main()


def test_profile_only_runs_one_profiled_process_per_engine_and_needs_a_profiled_workload(tmp_path, monkeypatch):
    args = peer.build_parser().parse_args(["run", "--workloads", "decode", "--sides", "vattn", "vllm", "--tp", "2",
                                           "--profile", "decode", "--profile-only"])
    (order,) = peer.prepare(args, "call-1", tmp_path).values()
    assert [(s.label, s.reps, s.profile) for s in order] == [("vattn-profile", 0, "decode"), ("vllm-profile", 0, "decode")]
    monkeypatch.setattr(sys, "argv", ["peer.py", "run", "--workloads", "w1", "--profile-only"])
    with pytest.raises(SystemExit, match="--profile-only runs the profiled processes only"):
        peer.main()


def test_vattn_side_runs_on_ray_with_tensor_parallelism(tmp_path):
    spec = tiny_side(tmp_path, 4, 8, WorkloadRun("w1", "", 5), reps=1, profile="w1",
                     profile_dir=str(tmp_path / "profiles"), profile_tokens=6)
    spec = replace(spec, engine_args=spec.engine_args | {"distributed": "ray", "tensor_parallel_size": 2})
    peer.run_vattn(spec, tmp_path / "result.json")
    result = SideResult.read(tmp_path / "result.json")
    assert [(r["workload"], r["output_tokens"]) for r in result.runs] == [("w1", 15)]
    assert result.engine_args["resolved"]["tensor_parallel_size"] == 2
    # the profile comes from the workers: a trace per TP rank, each split into the same steps
    assert result.profile_traces == [str(tmp_path / "profiles" / "vattn_w1" / f"vattn_pp0_tp{r}.pt.trace.json.gz")
                                     for r in (0, 1)] and result.profile_trace == result.profile_traces[0]
    names = [[s.name for s in trace_breakdown.steps(trace_breakdown.load(Path(t)), "^vattn_step_")]
             for t in result.profile_traces]
    assert names[0] == names[1] and "vattn_step_prefill(0)_decode(3)_seqs(3)" in names[0]


def test_the_memory_workload_gives_both_vllm_settings_the_same_kv_bytes(tmp_path):
    specs = peer.prepare(peer.build_parser().parse_args(["run", "--workloads", "memory"]), "call-1", tmp_path)
    vattn, vllm, defaults = specs["llama-3-8b 8 GiB"][:3]
    assert vattn.engine_args["kv_memory"] == vllm.engine_args["kv_cache_memory_bytes"] == 8 << 30
    assert defaults.engine_args == {"kv_cache_memory_bytes": 8 << 30}
    assert vattn.workloads[0].stepwise and vattn.engine_args["max_num_seqs"] == 256


def test_concurrency_is_the_peak_and_the_median_of_the_middle_steps():
    def stepped(label, counts, preemptions=None):
        r = side(label)
        r.runs[0].update(running=counts, **({"preemptions": preemptions} if preemptions is not None else {}))
        return r

    running = peer.concurrency([stepped("vattn", [1, 4, 6, 6, 5, 6, 2, 1], 3), stepped("vllm", [2, 5, 5, 4, 5, 4, 3, 1])])
    assert running["w1"]["vattn"]["peak"] == 6 and running["w1"]["vattn"]["steady"] == 6  # middle: 6 6 5 6
    assert running["w1"]["vllm"]["steady"] == 5 and running["w1"]["vattn"]["preemptions"] == 3
    assert running["w1"]["vattn_over_vllm"] == {"peak": 6 / 5, "steady": 6 / 5}


def test_vattn_side_counts_the_requests_running_in_each_step(tmp_path):
    spec = tiny_side(tmp_path, 2, 16, WorkloadRun("memory", "", 5, stepwise=True), reps=1)
    peer.run_vattn(spec, tmp_path / "result.json")
    run = SideResult.read(tmp_path / "result.json").runs[0]
    assert run["output_tokens"] == 15 and max(run["running"]) == 2  # max_num_seqs caps it
    assert sum(run["running"]) == 15  # each of the 15 tokens came in a step of its own request


def test_shared_prefix_and_chat_workloads_build_their_prompts_and_the_nocache_side(tmp_path):
    args = peer.build_parser().parse_args(["run", "--workloads", "prefix", "chat", "--sides", "vattn", "vattn-nocache",
                                           "vllm"])
    specs = peer.prepare(args, "call-1", tmp_path)["llama-3-8b 40 GiB"]
    assert [s.label for s in specs] == ["vattn", "vattn-nocache", "vllm", "vllm", "vattn-nocache", "vattn"]
    assert specs[1].engine_args["enable_prefix_caching"] is False and "enable_prefix_caching" not in specs[0].engine_args
    prefix, chat = specs[0].workloads
    prompts = prefix.prompts()
    assert len(prompts) == 512 and prefix.followups() == []
    starts = {tuple(p[:2048]) for p in prompts}
    assert len(starts) == 32  # 32 shared prefixes, 16 requests on each
    assert all(2048 + 256 <= len(p) <= 4096 + 256 for p in prompts)
    first, later = chat.prompts(), chat.followups()
    assert len(first) == 64 and len(later) == 5 and all(len(m) == 64 for m in later)
    assert len({tuple(p[:1024]) for p in first}) == 1  # one system prompt
    assert peer.WORKLOADS["chat"].max_len == 1024 + 256 + 5 * (256 + 128) + 128
    assert specs[0].engine_args["max_model_len"] == 4096 + 256 + 128  # the longer of the two
    assert not peer.WORKLOADS["prefix"].has_floor and peer.WORKLOADS["w1"].has_floor


def test_a_conversations_turns_run_on_the_engines_own_answers_from_an_empty_cache(tmp_path):
    followups = [[[30, 31, 32], [33], [34, 35]], [[36], [37, 38], [39]]]
    later = tmp_path / "followups.json"
    later.write_text(json.dumps(followups))
    spec = tiny_side(tmp_path, 4, 16, WorkloadRun("chat", "", 5, followups_file=str(later)), reps=2)
    spec = replace(spec, engine_args=spec.engine_args | {"page_size": 4096})  # 8 tokens a page
    peer.run_vattn(spec, tmp_path / "result.json")
    result = SideResult.read(tmp_path / "result.json")
    assert [r["output_tokens"] for r in result.runs] == [45, 45]  # 3 conversations x 3 turns x 5 tokens
    assert result.digests == {"chat": digest(PROMPTS, 5, followups)}
    # The same hit rate in both rounds: each starts from an empty cache; later turns find the earlier ones.
    rates = [r["prefix_hit_rate"] for r in result.runs]
    assert rates[0] == rates[1] and rates[0] > 0
