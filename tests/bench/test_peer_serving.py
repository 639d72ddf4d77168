"""bench/peer_serving.py, the served side-by-side against vLLM: the model directory both servers load, and the
comparison of their clients' numbers (the servers themselves run on the GPU machine)."""

from __future__ import annotations

import argparse
import json
import subprocess

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import peer_serving  # noqa: E402
from worker.config import ModelConfig  # noqa: E402
from worker.tokenizer import load_tokenizer  # noqa: E402


def test_the_model_directory_has_the_presets_shape_and_a_tokenizer_for_every_id(tmp_path):
    path = peer_serving.write_model_dir("llama-3-8b", tmp_path)
    config = ModelConfig.from_hf(path)
    assert (config.vocab_size, config.num_layers, config.num_kv_heads) == (128256, 32, 8)
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.decode([5, 31999, 128255]) == "tok5 tok31999 tok128255"
    assert tokenizer.encode("tok7 tok128000") == [7, 128000]
    transformers = pytest.importorskip("transformers")  # how vLLM's server loads it
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert hf.decode([5, 31999]) == "tok5 tok31999" and hf.eos_token_id == 2


def level(concurrency, tok_s, ttft50, ttft99, tpot50, errors=0, rate=None):
    return {"concurrency": concurrency, "rate": rate, "output_tok_s": tok_s, "errors": errors,
            "ttft_s": {"p50": ttft50, "p99": ttft99}, "tpot_s": {"p50": tpot50}}


def test_sides_are_compared_level_by_level_over_their_runs(tmp_path):
    def run(side, tok_s):
        return {"side": side, "ours": {"levels": [level(16, tok_s, 0.1, 0.3, 0.01), level(1024, tok_s / 2, 0.2, 0.5,
                                                                                           0.02, rate=4.0)]}}

    headers, rows, data = peer_serving.compare([run("vattn", 900), run("vllm", 1000), run("vllm", 1000),
                                                run("vattn", 1100)])
    assert headers[:4] == ["load", "vattn tok/s", "vLLM tok/s", "vattn / vLLM"]
    assert rows[0][:4] == ["16 clients", 1000, 1000, 1.0] and rows[1][0] == "4/s"
    assert data["levels"][1]["vattn_over_vllm"]["ttft_s:p50"] == 1.0
    # The figure draws both servers' bars at every level, whatever the levels' units.
    peer_serving.plot(data["levels"], tmp_path / "peer.png", "test")
    assert (tmp_path / "peer.png").stat().st_size > 10_000


def client_table():
    """``vllm_client_table`` of two runs a side, one of whose levels failed."""
    def run(side, tok_s, failed=False):
        levels = [{"concurrency": 16, "rate": None, "output_throughput": tok_s, "median_ttft_ms": 20.0,
                   "median_tpot_ms": 7.0, "request_timeline": {"decoding_mean": 15.0}},
                  {"concurrency": 64, "rate": None, "error": 1} if failed else
                  {"concurrency": 64, "rate": None, "output_throughput": 2 * tok_s, "median_ttft_ms": 40.0,
                   "median_tpot_ms": 9.0},
                  {"concurrency": None, "rate": 8.0, "output_throughput": tok_s / 2}]
        return {"side": side, "vllm_client": levels}

    return peer_serving.vllm_client_table([run("vattn", 900), run("vllm", 1000), run("vllm", 1200),
                                           run("vattn", 1100, failed=True)])


def test_vllm_clients_view_is_averaged_per_side_and_a_failed_level_is_left_out():
    headers, rows = client_table()
    assert headers[:6] == ["load", "tok/s vattn", "vLLM", "vattn / vLLM", "TTFT p50 ms vattn", "vLLM"]
    assert len(headers) == len(rows[0]) == 2 * len(peer_serving.CLIENT_COLUMNS) + 2
    column = {h: i for i, h in enumerate(headers) if h.endswith("vattn")}
    assert rows[0][:6] == ["16 clients", 1000, 1100, 1000 / 1100, 20.0, 20.0]
    assert rows[0][column["decoding vattn"]: column["decoding vattn"] + 2] == [15.0, 15.0]
    assert rows[0][column["TTFT p99 ms vattn"]] is None  # no run recorded it
    assert rows[1][:4] == ["64 clients", 1800, 2200, 1800 / 2200]  # the failed run is left out, not counted as 0
    assert rows[2][:3] == ["8/s", 500, 550]


def test_the_figure_draws_vllm_bench_serves_view_below_ours(tmp_path):
    headers, rows = client_table()
    ours = [{"load": "16 clients", **{side: {"output_tok_s": 1.0, "ttft_s:p50": 0.1, "ttft_s:p99": 0.2,
                                             "tpot_s:p50": None} for side in ("vattn", "vllm")}}]
    peer_serving.plot(ours, tmp_path / "one.png", "test")
    peer_serving.plot(ours, tmp_path / "two.png", "test", {"headers": headers, "rows": rows})
    from PIL import Image
    assert Image.open(tmp_path / "two.png").height == 2 * Image.open(tmp_path / "one.png").height


def test_vllm_clients_per_request_records_say_how_many_requests_were_decoding_and_how_long_they_stalled():
    # Two requests over 1 s: one from 0 (first token at 0.1 s, then 4 gaps of 10 ms and one of 60 ms), one from
    # 0.5 s (first token at 0.2 s, then 10 ms, two tokens together, 10 ms).
    result = {"start_times": [0.0, 0.5], "ttfts": [0.1, 0.2],
              "itls": [[0.01] * 4 + [0.06], [0.01, 0.0001, 0.01]]}
    timeline = peer_serving.request_timeline(result)
    assert timeline["median_itl_ms"] == pytest.approx(10)
    span = 0.5 + 0.2 + 0.0201  # the last request's end
    assert timeline["in_flight_mean"] == pytest.approx((0.2 + 0.2201) / span)
    assert timeline["decoding_mean"] == pytest.approx((0.1 + 0.0201) / span)
    assert timeline["stall_ms_per_request"] == pytest.approx((50 + 0) / 2)
    assert timeline["bunched_share"] == pytest.approx(1 / 8)
    assert "decoding_mean" not in peer_serving.request_timeline(result | {"start_times": None})
    assert peer_serving.request_timeline({"ttfts": [0.1]}) == {}  # a result saved without --save-detailed


def test_a_shared_prefix_run_asks_both_clients_for_the_same_prompts_and_the_servers_for_room():
    args = argparse.Namespace(prefixes=32, prefix_len=2048, input=256, output=128, max_num_seqs=256,
                              max_num_batched_tokens=8192, vllm_site="/v", kv_memory_gib=40, device="cuda",
                              dtype="bfloat16", profile=[], profile_rates=[], work=Path("/w"),
                              ingress_replicas=2, mixed_graph_tokens=2048, fused_prefix_pages=16)
    assert peer_serving.dataset_args(args) == [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "2048", "--prefix-repetition-suffix-len",
        "256", "--prefix-repetition-num-prefixes", "32", "--prefix-repetition-output-len", "128"]
    for side in ("vattn", "vllm"):
        command, _ = peer_serving.server_command(side, Path("/m"), args)
        assert command[command.index("--max-model-len") + 1] == str(2048 + 256 + 128 + 64)
        assert "--profiler-config" not in command
        assert ("--ingress-replicas" in command) == (side == "vattn")  # vattn's HTTP fronts; vLLM has one API server
    vattn, _ = peer_serving.server_command("vattn", Path("/m"), args)
    assert vattn[vattn.index("--ingress-replicas") + 1] == "2"
    assert vattn[vattn.index("--mixed-graph-tokens") + 1] == "2048"
    default, _ = peer_serving.server_command("vattn", Path("/m"), argparse.Namespace(**vars(args) | {"mixed_graph_tokens": None}))
    assert "--mixed-graph-tokens" not in default  # the engine's own default
    assert vattn[vattn.index("--fused-prefix-pages") + 1] == "16"
    unfused, _ = peer_serving.server_command("vattn", Path("/m"), argparse.Namespace(**vars(args) | {"fused_prefix_pages": 0}))
    assert "--fused-prefix-pages" not in unfused
    profiled, _ = peer_serving.server_command("vllm", Path("/m"), argparse.Namespace(**vars(args) | {"profile": [64]}))
    config = json.loads(profiled[profiled.index("--profiler-config") + 1])  # vLLM's torch profiler, idle until asked
    assert config["profiler"] == "torch" and config["torch_profiler_dir"] == "/w/vllm_traces"
    at_rates = argparse.Namespace(**vars(args) | {"profile_rates": [20.0]})  # a rate alone is profiled too
    assert "--profiler-config" in peer_serving.server_command("vllm", Path("/m"), at_rates)[0]
    assert peer_serving.profiled_loads(argparse.Namespace(profile=[64], profile_rates=[20.0, 40.0])) == [
        {"concurrency": 64, "rate": None}, {"concurrency": None, "rate": 20.0}, {"concurrency": None, "rate": 40.0}]
    # A rate's run lasts past its window by the settling before it and the trace after it: more than both
    assert peer_serving.arrivals(20.0, argparse.Namespace(profile_window=6)) / 20.0 > (
        peer_serving.RATE_SETTLE_S + 6 + 2)
    assert peer_serving.dataset_args(argparse.Namespace(prefixes=0, input=512, output=128))[:2] == ["--dataset-name",
                                                                                                   "random"]


def test_served_rate_is_set_against_the_offline_rate_on_the_same_prompts_per_closed_loop_level():
    def run(side, tok_s):  # a rate's level has no offline counterpart
        return {"side": side, "ours": {"levels": [level(64, tok_s, 0.1, 0.3, 0.01), level(256, 2 * tok_s, 0.2, 0.5, 0.02),
                                                  level(1024, tok_s, 0.1, 0.2, 0.01, rate=20.0)]}}

    offline_run = {"levels": [{"concurrency": 64, "requests": 384, "output_tok_s": 1000.0},
                              {"concurrency": 256, "requests": 1536, "output_tok_s": 2000.0}]}
    headers, rows, data = peer_serving.served_over_offline([run("vattn", 900), run("vllm", 5000), run("vattn", 800)],
                                                           offline_run)
    assert headers[-1] == "served / offline"
    assert rows[0] == [64, 384, "900 / 800", 1000.0, pytest.approx(0.85)]  # vattn's runs only
    assert data[1] == {"concurrency": 256, "served_tok_s": [1800, 1600], "offline_tok_s": 2000.0,
                       "served_over_offline": pytest.approx(0.85)}
    assert peer_serving.max_model_len(argparse.Namespace(prefix_len=0, input=512, output=128)) == 704


def test_an_offline_comparison_refuses_a_client_that_does_not_draw_greedily(tmp_path):
    done = subprocess.run([sys.executable, peer_serving.__file__, "--offline", "--client-temperature", "1",
                           "--work", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--offline sets the served rate against a greedy offline run" in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was written or started


def test_a_run_stopped_before_its_end_keeps_what_it_measured_and_finish_writes_its_results(tmp_path):
    args = argparse.Namespace(device="cpu", model="llama-3-8b", name="peer", work=tmp_path)
    progress = peer_serving.Progress(tmp_path / "peer.progress.json", args)

    def ours(tok_s):
        return {"levels": [level(64, tok_s, 0.4, 0.8, 0.009), level(256, 2 * tok_s, 1.6, 3.2, 0.029)]}

    def client(c, tok_s):
        return {"concurrency": c, "rate": None, "output_throughput": tok_s, "median_ttft_ms": 400.0,
                "median_tpot_ms": 7.7}

    vattn = {"side": "vattn", "start_s": 46.0, "ours": ours(5000), "vllm_client": [client(64, 5700), client(256, 7900)]}
    # vLLM's side stopped inside its second `vllm bench serve` level: what it finished is kept
    progress.keep([vattn, {"side": "vllm", "start_s": 90.0, "version": "0.26.0", "ours": ours(4900),
                           "vllm_client": [client(64, 6000)]}])
    kept = json.loads(progress.path.read_text())
    assert kept["device"] == "cpu" and len(kept["runs"]) == 2 and kept["args"]["model"] == "llama-3-8b"
    kept["device"] = "NVIDIA H200"  # as the GPU machine wrote it
    progress.path.write_text(json.dumps(kept))

    done = subprocess.run([sys.executable, peer_serving.__file__, "--finish", str(progress.path), "--name", "peer",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "out" / "peer.json").read_text())
    assert results["device"] == "NVIDIA H200" and "stopped before its end" in results["partial"]
    assert [row[:4] for row in results["table"]["rows"]] == [["64 clients", 5000, 4900, pytest.approx(5000 / 4900)],
                                                             ["256 clients", 10000, 9800, pytest.approx(10000 / 9800)]]
    client_rows = results["vllm_client_table"]["rows"]
    assert client_rows[0][:4] == ["64 clients", 5700, 6000, pytest.approx(0.95)]
    assert client_rows[1][:4] == ["256 clients", 7900, None, None]  # vLLM's level never ran
    assert (tmp_path / "out" / "peer.png").stat().st_size > 10_000
