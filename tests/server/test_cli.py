"""The ``vattn generate`` and ``vattn serve`` commands, run in-process (and ``serve`` once as its own process)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from cluster.cli import engine_config, kv_size
from server.cli import main
from server.serve_env import free_local_port


def test_generate_prints_json_per_prompt(capsys):
    code = main(["generate", "--prompt", "Hello", "--prompt", "abc", "--max-tokens", "4", "--kv-memory", "32MiB",
                 "--device", "cpu", "--json", "--ignore-eos"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "abc"]
    assert all(len(line["completions"][0]["token_ids"]) == 4 for line in lines)


def test_generate_with_and_without_prefix_caching_prints_the_same_tokens(capsys):
    tokens = []
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        argv = ["generate", "--prompt", "a shared start, then one", "--prompt", "a shared start, then two",
                "--max-tokens", "6", "--kv-memory", "32MiB", "--page-size", "4KiB", "--device", "cpu", "--json",
                "--ignore-eos", "--temperature", "0", flag]
        assert main(argv) == 0
        tokens.append([json.loads(line)["completions"][0]["token_ids"] for line in capsys.readouterr().out.splitlines()])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2


def test_generate_over_a_directory_with_dummy_weights(tmp_path, capsys):
    """vLLM's ``--load-format dummy``: a model directory with a config.json only, random weights at its shape."""
    config = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["generate", "--model", str(tmp_path), "--prompt", "Hi", "--max-tokens", "3", "--kv-memory", "16MiB",
            "--max-num-batched-tokens", "64", "--device", "cpu", "--json", "--ignore-eos"]
    assert main(argv + ["--load-format", "dummy"]) == 0
    assert len(json.loads(capsys.readouterr().out)["completions"][0]["token_ids"]) == 3
    assert main(argv) == 2  # its own weights: there are none
    assert "no *.safetensors" in capsys.readouterr().err


def test_bad_argument_is_a_clear_error(capsys):
    assert main(["generate", "--prompt", "x", "--max-tokens", "0", "--device", "cpu"]) == 2
    assert "max_tokens must be an int > 0, got 0" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_missing_attention_package_is_a_clear_error_before_loading(capsys):
    # No CUDA is touched before the backend's import fails, so this runs on a CPU machine too.
    assert main(["generate", "--prompt", "x", "--attention", "flash_attn", "--device", "cuda"]) == 2
    assert "attention backends 'flash_attn' and 'flash_attn_paged' need the flash-attn package" in capsys.readouterr().err


def test_generate_on_ray_with_tp_and_pp_prints_the_in_process_tokens(capsys):
    args = ["generate", "--prompt", "Hello", "--max-tokens", "6", "--kv-memory", "32MiB", "--device", "cpu", "--json",
            "--ignore-eos"]
    assert main(args) == 0
    local = capsys.readouterr().out
    assert main([*args, "--tp", "2", "--pp", "2"]) == 0  # starts a local Ray, stops it after
    assert json.loads(capsys.readouterr().out) == json.loads(local)


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "3"], "tensor_parallel_size=3 does not divide the model's num_heads=4"),
    (["--num-replicas", "0"], "num_replicas: Input should be greater than or equal to 1"),
    (["--model", "/nowhere"], "model '/nowhere' is neither a preset"),
    (["--kv-memory-fraction", "0"], "kv_memory_fraction: Input should be greater than 0"),
    (["--fused-prefix-pages", "-1"], "fused_prefix_pages: Input should be greater than or equal to 0"),
])
def test_serve_refuses_bad_options_before_ray_starts(capsys, argv, message):
    import ray

    assert main(["serve", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()


def test_serve_answers_and_a_sigterm_stops_it_leaving_the_port_free(tmp_path):
    """What a process manager does. HAProxy, on the port, outlives a killed Ray: the server must stop Serve itself."""
    port = free_local_port()
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", "tiny", "--device", "cpu",
                                "--port", str(port), "--kv-memory", "64MiB"], stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"RAY_ADDRESS": ""}, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        # It says at start what the pool holds: 64 MiB of the tiny model's 4 MiB pages at 1 KiB a token, its context 2,048.
        # (Once serve.run has returned, which may be after the server first answered.)
        while "KV cache" not in (text := (tmp_path / "serve.log").read_text()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ("KV cache: 16 pages, 0.06 GiB a worker, holds 65,536 tokens -- 32.0 requests of the full 2,048-token "
                "context at once") in text
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        with socket.socket() as s:
            # As a server binds (SO_REUSEADDR): connections the server closed may wait in TIME_WAIT on the port, but
            # nothing listens there any more.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if process.poll() is None:  # a failed assertion: SIGTERM first, so Serve stops the HAProxy later tests would meet
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def test_serve_that_cannot_start_exits_saying_what_its_replicas_raised(tmp_path):
    """A KV pool larger than the host's memory: refused by each worker as it starts, and ``vattn serve`` exits saying
    so, where Serve alone says only that a deployment failed (and on CPU the pool used to start and be killed later)."""
    import psutil

    too_much = f"{2 * psutil.virtual_memory().total >> 30}GiB"
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", "tiny", "--device", "cpu",
                           "--port", str(free_local_port()), "--kv-memory", too_much], capture_output=True, text=True,
                          env=os.environ | {"RAY_ADDRESS": ""}, timeout=300)
    assert done.returncode == 1
    assert re.search(r"vattn: error: the app did not start: .*\n  VattnEngine: ValueError: kv_memory: a KV pool of "
                     r"[0-9.]+ GiB is more than worker pp0 tp0's cpu memory has free", done.stderr), done.stderr[-2000:]


def test_vllm_spellings_of_the_engine_options_and_the_gpu_default_pool():
    from server.cli import _parser

    args = _parser().parse_args(["serve", "-tp", "2", "--pipeline-parallel-size", "2", "--enforce-eager",
                                 "--no-enable-prefix-caching"])
    assert (args.tp, args.pp, args.enforce_eager, args.enable_prefix_caching) == (2, 2, True, False)
    assert _parser().parse_args(["generate", "--prompt", "a", "--tensor-parallel-size", "2", "-pp", "3"]).tp == 2
    # No size given: on a GPU the share of memory the weights leave (as the chart), on CPU the engine's default.
    plain = _parser().parse_args(["serve"])
    assert kv_size(plain, "cuda") == {"kv_memory_fraction": 0.9} and kv_size(plain, "cpu") == {}
    sized = _parser().parse_args(["serve", "--kv-memory", "2GiB"])
    assert kv_size(sized, "cuda") == {"kv_memory": 2 << 30, "kv_memory_fraction": None}
    eager = engine_config(_parser().parse_args(["generate", "--prompt", "a", "--enforce-eager"]), "cuda")
    assert eager["cuda_graphs"] is False and eager["kv_memory_fraction"] == 0.9
    assert engine_config(_parser().parse_args(["generate", "--prompt", "a", "--deterministic"]), "cpu")["deterministic"]
    assert _parser().parse_args(["serve", "--deterministic"]).deterministic


def test_gpu_memory_utilization_is_vllms_flag_for_the_pool_and_takes_no_other_size():
    from server.cli import _parser

    args = _parser().parse_args(["serve", "--gpu-memory-utilization", "0.8"])
    assert kv_size(args, "cuda") == {"gpu_memory_utilization": 0.8}
    assert engine_config(args, "cuda")["gpu_memory_utilization"] == 0.8
    with pytest.raises(SystemExit):  # argparse: one size option at most
        _parser().parse_args(["serve", "--gpu-memory-utilization", "0.8", "--kv-memory", "2GiB"])


def test_uvicorn_log_level_is_vllms_flag():
    from server.cli import _parser

    assert _parser().parse_args(["serve", "--uvicorn-log-level", "warning"]).uvicorn_log_level == "warning"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--uvicorn-log-level", "loud"])
