"""bench/peer_serving.py, the served side-by-side against vLLM: the model directory both servers load, and the
comparison of their clients' numbers (the servers themselves run on the GPU machine)."""

from __future__ import annotations

import argparse
import json

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


def test_vllm_clients_view_is_averaged_per_side_and_a_failed_level_is_left_out():
    def run(side, tok_s, failed=False):
        levels = [{"concurrency": 16, "output_throughput": tok_s, "median_ttft_ms": 20.0, "median_tpot_ms": 7.0},
                  {"concurrency": 64, "error": 1} if failed else
                  {"concurrency": 64, "output_throughput": 2 * tok_s, "median_ttft_ms": 40.0, "median_tpot_ms": 9.0}]
        return {"side": side, "vllm_client": levels}

    headers, rows = peer_serving.vllm_client_table([run("vattn", 900), run("vllm", 1000), run("vllm", 1200),
                                                    run("vattn", 1100, failed=True)])
    assert headers[:3] == ["clients", "tok/s vattn", "vLLM"]
    assert rows == [[16, 1000, 1100, 20.0, 20.0, 7.0, 7.0], [64, 1800, 2200, 40.0, 40.0, 9.0, 9.0]]


def test_a_shared_prefix_run_asks_both_clients_for_the_same_prompts_and_the_servers_for_room():
    args = argparse.Namespace(prefixes=32, prefix_len=2048, input=256, output=128, max_num_seqs=256,
                              max_num_batched_tokens=8192, vllm_site="/v", kv_memory_gib=40, device="cuda",
                              dtype="bfloat16", profile=[], work=Path("/w"))
    assert peer_serving.dataset_args(args) == [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "2048", "--prefix-repetition-suffix-len",
        "256", "--prefix-repetition-num-prefixes", "32", "--prefix-repetition-output-len", "128"]
    for side in ("vattn", "vllm"):
        command, _ = peer_serving.server_command(side, Path("/m"), args)
        assert command[command.index("--max-model-len") + 1] == str(2048 + 256 + 128 + 64)
        assert "--profiler-config" not in command
    profiled, _ = peer_serving.server_command("vllm", Path("/m"), argparse.Namespace(**vars(args) | {"profile": [64]}))
    config = json.loads(profiled[profiled.index("--profiler-config") + 1])  # vLLM's torch profiler, idle until asked
    assert config["profiler"] == "torch" and config["torch_profiler_dir"] == "/w/vllm_traces"
    assert peer_serving.dataset_args(argparse.Namespace(prefixes=0, input=512, output=128))[:2] == ["--dataset-name",
                                                                                                   "random"]
