#!/usr/bin/env bash
# Prepares FlashInfer 0.7.2.post1 for the GPU machine, which has no network: one part of < 60 MiB that a
# single call carries. Everything is installed there with pip --no-index --no-deps --target, so only the
# real import closure of `import flashinfer` travels (bench/README.md: what is left out, and why that is safe).
#
# Run in the project's root:   tools/gpu_flashinfer_wheels.sh [--out DIR] [--prebuilt]
#   --out DIR    write DIR/part1 (+ DIR/smoke.py, a copy to read); default .gpu/fi (git-ignored)
#   --prebuilt   also build prebuilt.tar.gz: the decode, fa3 (SM90) and fa2 prefill JIT modules compiled
#                here for sm_90a; needs nvcc 13.0 and 15-25 min on 2 cores (fa3 alone 9-16 min)
# Then on the GPU machine, call 1 with carry [".gpu/fi/part1"]:
#   mkdir -p /tmp/fi_parts && cp -r .gpu/fi/part1/* /tmp/fi_parts/ && bash /tmp/fi_parts/install.sh \
#     && source /tmp/fisite/env.sh && python3 /tmp/fisite/smoke.py decode
# (FI_USE_PREBUILT=1 before `bash` loads the prebuilt modules instead of compiling them there.)
# The sources of install.sh and smoke.py are tools/flashinfer_install.sh and tools/flashinfer_smoke.py.
set -euo pipefail

out=""
prebuilt=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    --prebuilt) prebuilt=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
tools=$root/tools
out=${out:-$root/.gpu/fi}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Built beside the old part and swapped in only at the end, so a failed run leaves the old one intact.
new=$out/part1.new
rm -rf "$new" && mkdir -p "$new/wheels"

# ---- 1. wheels: exact versions, pinned by hash (PyPI files never change, so a mismatch means a wrong file)
# cp312 builds for the machine's Python 3.12; the rest are py3-none. Only what `import flashinfer` and
# tvm_ffi import (torch, numpy, jinja2, filelock are in the image); nvidia-curand only feeds extras.tar.gz.
# pip takes --platform tags literally (no older-glibc expansion): manylinux_2_27 is nvidia-curand's tag.
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
cat > "$work/req.txt" <<'REQ'
flashinfer-python==0.7.2.post1 --hash=sha256:bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49
apache-tvm-ffi==0.1.15.post2 --hash=sha256:059eed9bfc94bcd41650fb8eefde74040a1bc7e7b1a6f0a8ff897b02b118875b
ninja==1.13.2 --hash=sha256:65a24341b5ac09fcadcc37082660be40a94174e51a937fabf6e2cae26225fa2c
packaging==26.3 --hash=sha256:d7193f7c8e4e93f444fde0262bf90af30e16fa0ad0ad44cb553c87339b23cd1c
requests==2.34.2 --hash=sha256:2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0
urllib3==2.8.0 --hash=sha256:0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3
idna==3.20 --hash=sha256:ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c
certifi==2026.10.18 --hash=sha256:73191c47aaa79da394e8fee2dbc2ec827432cab56311122c9e47abf79e390f62
charset-normalizer==3.5.2 --hash=sha256:3d31298449090ab8d47b7b1b2a555ff73cac7ed438a08b7ac160980c7ebed649
nvidia-ml-py==13.615.71 --hash=sha256:959bf4adf6fe1308e4bd739e722236b0d1ec8392e2cefad33ff70c311380b9b6
tqdm==4.70.1 --hash=sha256:c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73
typing-extensions==4.16.0 --hash=sha256:481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8
nvidia-curand==10.4.0.35 --hash=sha256:1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc
REQ
mkdir -p "$work/dl"
"$PY" -m pip download -q --no-deps --require-hashes "${plat[@]}" -r "$work/req.txt" -d "$work/dl"
for f in "$work"/dl/*.whl; do
  case $(basename "$f") in
    nvidia_curand-*) ;;                     # headers only, see step 3
    flashinfer_python-*) ;;                 # trimmed in step 2
    *) mv "$f" "$new/wheels/" ;;
  esac
done

# ---- 2. trim flashinfer's wheel (62 MB -> 46 MB) so the part fits one call's carry limit.
# The three directories are read only when their own JIT modules (cake sampling, KDA, DeepSeek-V4 MLA)
# are generated; decode/prefill never include them (checked with nvcc -M, see README.txt).
# Same zipfile settings as the hand-made set (deflate level 9, original entry metadata), RECORD lines
# of the removed files dropped so pip installs it without complaint.
"$PY" - "$work"/dl/flashinfer_python-*.whl "$new/wheels" "$new/TRIMMED_FILES.txt" <<'PYEOF'
import os, sys, zipfile
src, dstdir, listing = sys.argv[1:4]
dst = os.path.join(dstdir, os.path.basename(src))
REMOVE = ("flashinfer/data/csrc/cake_sampling/generated/", "flashinfer/data/csrc/kda/",
          "flashinfer/data/csrc/cake_dsv4/")
removed, kept = [], 0
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
    for info in zi.infolist():
        n = info.filename
        if n.startswith(REMOVE):
            removed.append((n, info.file_size))
            continue
        data = zi.read(n)
        if n.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True) if not l.startswith(REMOVE)).encode()
        zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        kept += 1
with open(listing, "w") as f:
    for n, s in removed:
        f.write(f"{s}\t{n}\n")
print(f"trimmed {os.path.basename(src)}: removed {len(removed)} files "
      f"({sum(s for _, s in removed):,} bytes uncompressed), kept {kept}; "
      f"{os.path.getsize(src):,} -> {os.path.getsize(dst):,} bytes")
PYEOF

# ---- 3. extras.tar.gz: what a pip-assembled CUDA 13.0 toolkit on the machine may lack.
# include/: curand headers (nvidia-curand 10.4.0.35 = CUDA 13.0); the fa3 SM90 kernels include
#   curand_kernel.h through cutlass/util. install.sh adds them with -isystem only if $CUDA_HOME has none.
# cuda_stubs/libcuda.so: FlashInfer links every module with -lcuda; a toolkit without lib64/stubs has
#   nothing to link against. An empty library with SONAME libcuda.so.1 records the right DT_NEEDED;
#   the driver's real libcuda.so.1 satisfies it at load time.
mkdir -p "$work/extras/include" "$work/extras/cuda_stubs"
"$PY" - "$work"/dl/nvidia_curand-*.whl "$work/extras/include" <<'PYEOF'
import os, sys, zipfile
whl, dst = sys.argv[1:3]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("nvidia/cu13/include/") and n.endswith(".h"):
            name = os.path.basename(n)
        elif n.endswith(".dist-info/licenses/License.txt"):
            name = "LICENSE.curand.txt"
        else:
            continue
        with open(os.path.join(dst, name), "wb") as f:
            f.write(z.read(n))
PYEOF
# file name stub.c and -nostdlib: reproduces the hand-made stub byte for byte with gcc 12.2
printf 'int flashinfer_libcuda_link_stub(void) { return 0; }\n' > "$work/stub.c"
(cd "$work" && gcc -shared -fPIC -nostdlib -Wl,-soname,libcuda.so.1 -o extras/cuda_stubs/libcuda.so stub.c)
# deterministic archive: sorted names, fixed mtime/owner, no gzip timestamp
tarx=(--sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner)
tar -C "$work/extras" "${tarx[@]}" -cf - include cuda_stubs | gzip -9n > "$new/extras.tar.gz"

# ---- 4. install.sh, smoke.py, marker
cp "$tools/flashinfer_install.sh" "$new/install.sh" && chmod 755 "$new/install.sh"
cp "$tools/flashinfer_smoke.py" "$new/smoke.py"
: > "$new/PART1_OF_1"

# ---- 5. optional: prebuilt JIT modules (for a machine whose nvcc/host compiler cannot build them).
# Built exactly as on the machine: install.sh itself installs the part (with this interpreter's builds of
# the two binary wheels swapped in) and probes the toolchain; then FlashInfer's own JIT (ninja + nvcc,
# -gencode=arch=compute_90a,code=sm_90a) builds the three modules the smoke test needs, and each .so is
# stored as flashinfer/data/aot/<name>/<name>.so, which FlashInfer loads instead of compiling.
if [ "$prebuilt" = 1 ]; then
  nvv=$(nvcc --version 2>&1 || true)
  [[ $nvv == *"release 13.0"* ]] || { echo "--prebuilt needs nvcc 13.0 on PATH (found: ${nvv##*$'\n'})" >&2; exit 1; }
  # torch is imported by `import flashinfer`; a CPU build is enough. FI_TORCH_SITE: a --target dir
  # holding one already (skips the install); otherwise torch==2.13.0+cpu (this image's local wheel).
  tsite=${FI_TORCH_SITE:-}
  if [ -z "$tsite" ] && ! "$PY" -c 'import torch' 2>/dev/null; then
    tsite=$work/torch
    "$PY" -m pip install -q --no-compile --target "$tsite" "${FI_TORCH_SPEC:-torch==2.13.0+cpu}"
  fi
  stage=$work/stage
  cp -r "$new" "$stage"
  rm "$stage"/wheels/apache_tvm_ffi-* "$stage"/wheels/charset_normalizer-*
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$stage/wheels" \
    apache-tvm-ffi==0.1.15.post2 charset-normalizer==3.5.2
  (cd "$stage" && sha256sum wheels/*.whl extras.tar.gz install.sh smoke.py > SHA256SUMS)
  PYTHONPATH=${tsite:+$tsite:}${PYTHONPATH:-} PYTHON=$PY FI_PARTS=$stage FISITE=$work/site \
    bash "$stage/install.sh" > "$work/install.log" 2>&1 || { cat "$work/install.log" >&2; exit 1; }
  (
    set +u
    # shellcheck disable=SC1091
    source "$work/site/env.sh"
    export PYTHONPATH=${tsite:+$tsite:}$PYTHONPATH FLASHINFER_WORKSPACE_BASE=$work/ws
    "$PY" - "$work/prebuilt/aot" <<'PYEOF'
import os, shutil, sys, time
import torch
import flashinfer.prefill as P
from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
from flashinfer.utils import PosEncodingMode
bf = torch.bfloat16
# bf16 q/kv/o, int32 indices, head_dim 128/128, no posenc, no sliding window, no logits cap (smoke.py's case)
args = (bf, bf, bf, torch.int32, 128, 128, PosEncodingMode.NONE.value, False, False)
specs = {"decode": gen_batch_decode_module(*args),
         "fa3": gen_batch_prefill_module("fa3", *args, False),
         "fa2": P._gen_batch_prefill_primary_module("fa2", *args, False)}
for which, s in specs.items():
    t = time.time()
    s.build(verbose=False)
    m = s.load()  # dlopen + tvm_ffi symbol table: catches a broken link here
    so = str(s.jit_library_path)
    d = os.path.join(sys.argv[1], s.name)
    os.makedirs(d, exist_ok=True)
    shutil.copy2(so, os.path.join(d, s.name + ".so"))
    print(f"built {which}: {s.name}.so {os.path.getsize(so):,} bytes in {time.time() - t:.0f}s", flush=True)
PYEOF
  )
  tar -C "$work/prebuilt" "${tarx[@]}" -cf - aot | gzip -9n > "$new/prebuilt.tar.gz"
elif [ -f "$out/part1/prebuilt.tar.gz" ]; then
  echo "note: no --prebuilt: the new part1 has no prebuilt.tar.gz (FI_USE_PREBUILT=1 will not work with it)"
fi

# ---- 6. checksums (install.sh verifies them), swap in, size check
(cd "$new" && sha256sum wheels/*.whl extras.tar.gz $([ -f prebuilt.tar.gz ] && echo prebuilt.tar.gz) \
   install.sh smoke.py > SHA256SUMS)
total=$(find "$new" -type f -printf '%s\n' | awk '{s+=$1} END {print s}')
limit=$((60 * 1024 * 1024))
[ "$total" -lt "$limit" ] || { echo "part1 is $total bytes, over the 60 MiB budget; left in $new" >&2; exit 1; }
rm -rf "$out/part1" && mv "$new" "$out/part1"
cp "$tools/flashinfer_smoke.py" "$out/smoke.py"
(cd "$out/part1" && find . -type f -printf '%10s  %P\n' | sort -k2)
echo "part1 total: $total bytes ($(awk -v t="$total" 'BEGIN {printf "%.1f", t/1048576}') MiB) in $out/part1"
