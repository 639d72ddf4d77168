#!/usr/bin/env bash
# Offline install of FlashInfer 0.7.2.post1 (trimmed) + runtime deps into /tmp/fisite.
# Run on the GPU machine after every part's files were copied into /tmp/fi_parts:
#   mkdir -p /tmp/fi_parts && cp -r .gpu/fi/partN/* /tmp/fi_parts/
# Exit codes: 3 = a part is missing / corrupt, 4 = install failed, 5 = import check failed.
# Afterwards:  source /tmp/fisite/env.sh
set -uo pipefail

NPARTS=1
P=${FI_PARTS:-/tmp/fi_parts}
T=${FISITE:-/tmp/fisite}
PY=${PYTHON:-python3}

# ---- 1. all parts present and intact ------------------------------------------------
missing=0
for i in $(seq 1 "$NPARTS"); do
  if [ ! -f "$P/PART${i}_OF_${NPARTS}" ]; then
    echo "install.sh: part $i of $NPARTS is missing in $P" \
         "(run: mkdir -p $P && cp -r .gpu/fi/part$i/* $P/)" >&2
    missing=1
  fi
done
[ "$missing" = 0 ] || exit 3
cd "$P" || exit 3
if ! sha256sum -c --quiet SHA256SUMS; then
  echo "install.sh: checksum mismatch in $P (re-copy the parts)" >&2
  exit 3
fi

# ---- 2. install wheels (no index, no dependency resolution) --------------------------
rm -rf "$T" && mkdir -p "$T" || exit 4
if "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$T" "$P"/wheels/*.whl || exit 4
else
  echo "install.sh: pip not available, unpacking wheels with zipfile"
  "$PY" - "$T" "$P"/wheels/*.whl <<'PYEOF' || exit 4
import os, shutil, stat, sys, zipfile
t = sys.argv[1]
for whl in sys.argv[2:]:
    with zipfile.ZipFile(whl) as z:
        z.extractall(t)
for d in [x for x in os.listdir(t) if x.endswith(".data")]:
    src = os.path.join(t, d)
    for sub in os.listdir(src):
        s = os.path.join(src, sub)
        dst = os.path.join(t, "bin") if sub == "scripts" else t
        os.makedirs(dst, exist_ok=True)
        for n in os.listdir(s):
            shutil.move(os.path.join(s, n), os.path.join(dst, n))
            if sub == "scripts":
                p = os.path.join(dst, n)
                os.chmod(p, os.stat(p).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    shutil.rmtree(src)
PYEOF
fi
mkdir -p "$T/extras" && tar xzf "$P/extras.tar.gz" -C "$T/extras" || exit 4
if [ "${FI_USE_PREBUILT:-0}" = 1 ]; then
  # Modules JIT-built on the CPU box (nvcc 13.0.88, sm_90a, gcc 12; need libcudart.so.13,
  # GLIBCXX_3.4.29): FlashInfer treats data/aot/<name>/<name>.so as AOT, loads it instead of
  # compiling, and falls back to the JIT build if loading fails.
  tar xzf "$P/prebuilt.tar.gz" -C "$T/flashinfer/data" || exit 4
  echo "FI_USE_PREBUILT=1: installed prebuilt modules:"; ls "$T/flashinfer/data/aot"
fi
chmod +x "$T/bin/ninja" 2>/dev/null

# ---- 3. toolchain probes --------------------------------------------------------------
# NOTE: `nvcc` on PATH may be a wrapper script (e.g. /usr/local/bin/nvcc doing
# `exec /usr/local/cuda-13.0/bin/nvcc`); FlashInfer's own fallback (dirname of `which nvcc`)
# would then pick CUDA_HOME=/usr/local and fail to link -lcudart. Ask nvcc where it lives.
if [ -z "${CUDA_HOME:-}" ]; then
  here=""
  if command -v nvcc >/dev/null 2>&1; then
    here=$(cd /tmp && nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
  fi
  if [ -n "$here" ] && [ -x "$here/nvcc" ]; then
    CUDA_HOME=$(readlink -f "$here/..")
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    CUDA_HOME=$(readlink -f /usr/local/cuda)
  else
    CUDA_HOME=/usr/local/cuda
  fi
fi
echo "CUDA_HOME=$CUDA_HOME"
"$CUDA_HOME/bin/nvcc" --version | tail -2 || echo "WARNING: $CUDA_HOME/bin/nvcc not runnable: JIT will fail" >&2
CXX_BIN=${CXX:-c++}
if ! command -v "$CXX_BIN" >/dev/null 2>&1; then
  if command -v g++ >/dev/null 2>&1; then CXX_BIN=g++; export CXX=g++; else
    echo "WARNING: no c++/g++ host compiler found: JIT will fail" >&2; fi
fi
EXTRA_CUDAFLAGS=""
EXTRA_LDFLAGS=""
# curand_kernel.h is included (via cutlass/util) by the SM90 (fa3) prefill kernels; a
# pip-assembled CUDA 13.0 toolkit has no curand headers -> use the shipped copies
# (nvidia-curand 10.4.0.35 = CUDA 13.0), added with -isystem AFTER $CUDA_HOME/include.
if [ ! -f "$CUDA_HOME/include/curand_kernel.h" ] && \
   [ ! -f "$CUDA_HOME/targets/x86_64-linux/include/curand_kernel.h" ]; then
  echo "curand_kernel.h not in $CUDA_HOME: using shipped headers $T/extras/include"
  EXTRA_CUDAFLAGS="-isystem $T/extras/include"
fi
# FlashInfer links every JIT module with: -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda
tmpd=$(mktemp -d)
echo 'int fi_probe(void){return 0;}' > "$tmpd/p.c"
linkprobe() { "$CXX_BIN" -shared -fPIC "$tmpd/p.c" -o "$tmpd/p.so" \
    -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" "$@" >"$tmpd/log" 2>&1; }
if ! linkprobe -lcudart; then
  for d in "$CUDA_HOME/lib" "$CUDA_HOME/targets/x86_64-linux/lib"; do
    [ -e "$d/libcudart.so" ] && EXTRA_LDFLAGS="$EXTRA_LDFLAGS -L$d"
  done
  linkprobe $EXTRA_LDFLAGS -lcudart || { echo "WARNING: cannot link -lcudart:" >&2; cat "$tmpd/log" >&2; }
fi
if ! linkprobe $EXTRA_LDFLAGS -lcudart -lcuda; then
  if linkprobe $EXTRA_LDFLAGS -L"$T/extras/cuda_stubs" -lcudart -lcuda; then
    echo "no linkable libcuda.so found: using shipped link stub $T/extras/cuda_stubs (SONAME libcuda.so.1)"
    EXTRA_LDFLAGS="$EXTRA_LDFLAGS -L$T/extras/cuda_stubs"
  else
    echo "WARNING: link probe failed even with the libcuda stub:" >&2; cat "$tmpd/log" >&2
  fi
fi
rm -rf "$tmpd"
EXTRA_LDFLAGS=${EXTRA_LDFLAGS# }

# ---- 4. env file ---------------------------------------------------------------------
cat > "$T/env.sh" <<EOF
export PYTHONPATH=$T\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$T/bin:$CUDA_HOME/bin:\$PATH
export CUDA_HOME=$CUDA_HOME
export FLASHINFER_WORKSPACE_BASE=\${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
export FLASHINFER_CUDA_ARCH_LIST=\${FLASHINFER_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=\${MAX_JOBS:-$(nproc)}
EOF
[ -n "$EXTRA_CUDAFLAGS" ] && echo "export FLASHINFER_EXTRA_CUDAFLAGS=\"$EXTRA_CUDAFLAGS\"" >> "$T/env.sh"
[ -n "$EXTRA_LDFLAGS" ] && echo "export FLASHINFER_EXTRA_LDFLAGS=\"$EXTRA_LDFLAGS\"" >> "$T/env.sh"
[ -n "${CXX:-}" ] && echo "export CXX=$CXX" >> "$T/env.sh"
cp "$P/smoke.py" "$T/smoke.py" 2>/dev/null

# ---- 5. check -------------------------------------------------------------------------
# shellcheck disable=SC1091
source "$T/env.sh"
echo "ninja $(ninja --version) at $(command -v ninja)"
"$PY" - <<'PYEOF' || exit 5
import time, importlib.util
t = time.time()
import torch, flashinfer, tvm_ffi
print(f"import flashinfer {flashinfer.__version__} ok in {time.time()-t:.1f}s; torch {torch.__version__} "
      f"(cuda {torch.version.cuda}); tvm_ffi {tvm_ffi.__version__}; "
      f"cuda-python (cuda.cudart) present: {importlib.util.find_spec('cuda') is not None and importlib.util.find_spec('cuda.cudart') is not None}")
from flashinfer.jit import env as jit_env
print("JIT build dir:", jit_env.FLASHINFER_JIT_DIR)
PYEOF
echo "================ env to use (also in $T/env.sh) ================"
cat "$T/env.sh"
echo "then e.g.:  source $T/env.sh && $PY $T/smoke.py decode"
