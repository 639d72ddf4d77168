"""``serve_config.yaml`` as Ray Serve reads it: its schema, its import path, its args through the builder Serve
calls; the application it describes comes up and answers. Bad args fail before anything starts, naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema
from ray._common.utils import import_attr

from server.app import app_builder
from tests.server.conftest import serving

CONFIG = Path(__file__).parents[2] / "serve_config.yaml"


def test_the_config_file_starts_a_serving_app():
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "server.app:app_builder"
    build = import_attr(app.import_path)
    with serving(lambda: call_user_app_builder_with_args_if_necessary(build, app.args), name=app.name,
                 route_prefix=app.route_prefix) as url:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("args", "message"), [
    ({"kv_memory": "lots"}, "kv_memory: Value error, 'lots' is not a size"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size: Input should be greater than or equal to 1"),
    ({"kv_layot": "mega"}, "kv_layot: Extra inputs are not permitted"),
    ({"device": "tpu"}, "device: Input should be 'cpu' or 'cuda'"),
    ({"model": "/nowhere"}, "model '/nowhere' is neither a preset"),
    ({"kv_memory_fraction": 1.2}, "kv_memory_fraction: Input should be less than or equal to 1"),
    ({"kv_memory": "2GiB", "kv_memory_fraction": 0.9}, r"set kv_memory \(2147483648 bytes\) or kv_memory_fraction \(0.9\), not both"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization: Input should be greater than 0"),
    ({"kv_memory": "2GiB", "kv_memory_fraction": 0.5, "gpu_memory_utilization": 0.8},
     r"set kv_memory \(2147483648 bytes\) or kv_memory_fraction \(0.5\) or gpu_memory_utilization \(0.8\), not all"),
])
def test_bad_args_are_refused_naming_the_field(args, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        app_builder(args)


def test_several_api_keys_come_as_a_list_comma_separated_or_from_the_environment(monkeypatch):
    from server.args import ServeArgs

    assert ServeArgs.parse({"api_key": ["a", "b"]}).settings().api_keys == ("a", "b")
    assert ServeArgs.parse({"api_key": "a, b,"}).settings().api_keys == ("a", "b")
    monkeypatch.setenv("VATTN_API_KEY", "k1,k2")
    assert ServeArgs.parse({}).settings().api_keys == ("k1", "k2")
    assert ServeArgs.parse({"api_key": "own"}).settings().api_keys == ("own",)  # given beats the environment
    monkeypatch.delenv("VATTN_API_KEY")
    assert ServeArgs.parse({}).settings().api_keys == ()  # open


@pytest.mark.parametrize(("level", "serve_level", "access"), [("warning", "WARNING", False), ("info", "INFO", True),
                                                              ("trace", "DEBUG", True)])
def test_uvicorn_log_level_sets_what_both_deployments_log(level, serve_level, access):
    """vLLM's --uvicorn-log-level: Serve's replicas (the HTTP front and the engine) log at that level, and write
    access lines only at info and below."""
    ingress = app_builder({"uvicorn_log_level": level, "device": "cpu"})._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    for deployment in (ingress, engine):
        logging = deployment._deployment_config.logging_config
        assert (logging["log_level"], logging["enable_access_log"]) == (serve_level, access), deployment.name
