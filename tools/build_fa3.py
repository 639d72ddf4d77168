"""Build FlashAttention-3's forward kernels (flash-attention's ``hopper/``) for the ``fa3`` attention backend.

FlashAttention-3 is not on PyPI; its source is the flash-attention repository's ``hopper/`` directory, and
its full build (five head dims, three dtypes, paged, softcap, backward, sm80 fallbacks) takes hours. The
``fa3`` backend runs one forward call a step that prefills, over the virtual cache through a page table (varlen
queries, ``cache_seqlens``), so this compiles just the forward kernels FA3's dispatch can reach from there: the
head dims and dtype asked, with paged KV, split-KV and packed GQA, everything else switched off with the
package's own ``FLASHATTENTION_DISABLE_*`` flags (its dispatch then never names a kernel left out). CUTLASS's headers come at the revision flash-attention
pins as its ``csrc/cutlass`` submodule (flash-attn's sdist ships only part of them). The result is importable
from ``--out``:

    git -C flash-attention archive --prefix=fa/ v2.8.3.post1 hopper | gzip > fa3_hopper.tar.gz
    git -C cutlass archive --prefix=cutlass/ $(git -C flash-attention rev-parse v2.8.3.post1:csrc/cutlass) include \
        | gzip > cutlass_include.tar.gz
    python tools/build_fa3.py --hopper fa3_hopper.tar.gz --cutlass cutlass_include.tar.gz --out /tmp/fa3
    PYTHONPATH=/tmp/fa3 python -c "import flash_attn_interface"
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tarfile
import time
from pathlib import Path

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = ("bf16", "fp16")
# Features the backend never uses; LOCAL/APPENDKV/SOFTCAP/CLUSTER also halve the kernels per file.
DISABLED = ("BACKWARD", "APPENDKV", "LOCAL", "SOFTCAP", "FP8", "CLUSTER", "SM8x")
NVCC_FLAGS = [  # as hopper/setup.py compiles them
    "-O3", "-std=c++17", "--ftemplate-backtrace-limit=0", "--use_fast_math", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
    "-DCUTLASS_ENABLE_GDC_FOR_SM90", "-DCUTLASS_DEBUG_TRACE_LEVEL=0", "-DNDEBUG",
]


def extract(archive: Path, into: Path) -> Path:
    """The archive's top directory under ``into``, extracted once (aside, then renamed: a rerun resumes)."""
    if not into.is_dir():
        shutil.rmtree(into.with_suffix(".partial"), ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(into.with_suffix(".partial"), filter="data")
        into.with_suffix(".partial").rename(into)
    (root,) = into.iterdir()
    return root


# Decode tiles: a decode call holds at most a few query rows per KV head (GQA packed: 4 for Llama-3-8B), yet
# FA3 v2.8.3 runs head dim 128 on 128-row tiles over two MMA warpgroups, so half the tensor-core, softmax and
# barrier work of each K/V block is padding. With decode tiles, calls of <= 64 packed query rows per KV head run
# 64-row tiles on one MMA warpgroup (the kernels already support it: head dim 64 with V of 512 uses it), the way
# vLLM's FA3 fork runs decode; every tile-size query in flash_api.cpp asks the same question, so splits, packing
# and the scheduler's block counts match the kernel launched. VATTN_FA3_DECODE_TILES=0 turns it off at run time
# (bench/kv_arrangement.py times both in one process).
DECODE_TILES_RULE = """
#include <cstdlib>
#include <cstring>
#include "flash.h"

// vattn (tools/build_fa3.py): 64-row tiles on one MMA warpgroup for decode-shaped calls of head dim 128.
inline bool vattn_decode_tiles(Flash_fwd_params const& params) {
    char const* off = std::getenv("VATTN_FA3_DECODE_TILES");
    return params.arch >= 90 && params.d == 128 && !params.is_local
        && params.seqlen_q * (params.h / params.h_k) <= 64 && !(off && std::strcmp(off, "0") == 0);
}
"""
DECODE_TILES_EDITS = {  # file: [(text as published, text with decode tiles, occurrences)]
    "heuristics.h": [("#include <vector>\n", "#include <vector>\n" + DECODE_TILES_RULE, 1)],
    "tile_size.h": [
        ("bool v_colmajor=false, bool paged_kv_non_TMA=false, bool softcap=false) {",
         "bool v_colmajor=false, bool paged_kv_non_TMA=false, bool softcap=false, bool decode_tiles=false) {", 1),
        ("return {128, is_causal || is_local || paged_kv_non_TMA ? 128 : 176, true, true};",
         "return {decode_tiles ? 64 : 128, is_causal || is_local || paged_kv_non_TMA ? 128 : 176, true, true};", 1),
    ],
    "flash_api.cpp": [("params.softcap > 0.f);", "params.softcap > 0.f, vattn_decode_tiles(params));", 4)],
    "flash_fwd_launch_template.h": [
        ('#include "epilogue_fwd.hpp"\n', '#include "epilogue_fwd.hpp"\n#include "heuristics.h"\n', 1),
        ("bool PackGQA, bool Split, bool V_colmajor>\nvoid run_flash_fwd(",
         "bool PackGQA, bool Split, bool V_colmajor, bool DecodeTiles>\nvoid run_flash_fwd(", 1),
        ("V_colmajor, PagedKVNonTMA, Has_softcap);", "V_colmajor, PagedKVNonTMA, Has_softcap, DecodeTiles);", 1),
        ("            VARLEN_SWITCH(params.cu_seqlens_q || params.cu_seqlens_k || params.seqused_q || params.seqused_k || params.leftpad_k, Varlen, [&] {\n",
         "            VARLEN_SWITCH(params.cu_seqlens_q || params.cu_seqlens_k || params.seqused_q || params.seqused_k || params.leftpad_k, Varlen, [&] {\n"
         "              BOOL_SWITCH(vattn_decode_tiles(params), DecodeTiles_, [&] {\n"
         "                static constexpr bool DecodeTiles = DecodeTiles_ && Arch >= 90 && kHeadDim == 128;  // else one kernel\n", 1),
        ("V_colmajor, PagedKVNonTMA, Has_softcap)) : 128;", "V_colmajor, PagedKVNonTMA, Has_softcap, DecodeTiles)) : 128;", 1),
        ("PackGQA, Split, V_colmajor>(params, stream);\n                        });\n                    });\n                });\n",
         "PackGQA, Split, V_colmajor, DecodeTiles>(params, stream);\n                        });\n                    });\n                });\n"
         "              });\n", 1),
    ],
}


def add_decode_tiles(hopper: Path) -> None:
    """Edits the extracted ``hopper/`` sources for decode tiles (above); each edit must match as often as it
    does in the release the archive is pinned to, so another release fails here, not in a kernel."""
    for name, edits in DECODE_TILES_EDITS.items():
        path = hopper / name
        text = path.read_text()
        if edits[0][1] in text:
            continue  # a rerun over sources already edited
        for old, new, count in edits:
            if text.count(old) != count:
                raise SystemExit(f"{path}: expected {count} x {old[:60]!r}, found {text.count(old)}: "
                                 "not flash-attention v2.8.3.post1's hopper/? (--no-decode-tiles builds it as published)")
            text = text.replace(old, new)
        path.write_text(text)


def build(hopper_tar: Path, cutlass_tar: Path, out: Path, head_dims: list[int], dtypes: list[str], jobs: int,
          decode_tiles: bool = True) -> Path:
    from torch.utils.cpp_extension import load

    hopper = extract(hopper_tar, out / "src") / "hopper"
    if decode_tiles:
        add_decode_tiles(hopper)
    cutlass = extract(cutlass_tar, out / "cutlass") / "include"
    sources = [hopper / "flash_api.cpp", hopper / "flash_fwd_combine.cu", hopper / "flash_prepare_scheduler.cu"]
    sources += [hopper / "instantiations" / f"flash_fwd_hdim{h}_{d}{variant}_sm90.cu"
                for h in head_dims for d in dtypes for variant in ("", "_split", "_packgqa", "_paged", "_paged_split")]
    disabled = [*DISABLED, *(f"HDIM{h}" for h in HEAD_DIMS if h not in head_dims), *(["FP16"] if "fp16" not in dtypes else [])]
    defines = [f"-DFLASHATTENTION_DISABLE_{name}" for name in disabled]
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # FA3's wgmma/TMA kernels need sm_90a
    os.environ["MAX_JOBS"] = str(jobs)
    (out / "build").mkdir(parents=True, exist_ok=True)
    (out / "build" / "lock").unlink(missing_ok=True)  # left by a killed build; torch's load() would wait on it
    start = time.perf_counter()
    # is_python_module=False: loading registers the torch ops here; the package below imports them itself.
    load(
        name="_C", sources=[str(s) for s in sources], extra_cflags=["-O3", "-std=c++17", *defines],
        extra_cuda_cflags=[*NVCC_FLAGS, *defines, "--threads", "2"], extra_include_paths=[str(hopper), str(cutlass)],
        build_directory=str(out / "build"), verbose=True, is_python_module=False,
    )
    print(f"built {len(sources)} sources in {time.perf_counter() - start:.0f} s")
    package = out / "flash_attn_3"
    package.mkdir(exist_ok=True)
    version = re.search(r"^__version__\s*=\s*(.+)$", (hopper / "__init__.py").read_text(), re.M).group(1)
    (package / "__init__.py").write_text(f"__version__ = {version}  # flash-attention's hopper/, built by vattn\n"
                                         f"vattn_decode_tiles = {decode_tiles}  # tools/build_fa3.py\n")
    shutil.copy(out / "build" / "_C.so", package / "_C.so")
    shutil.copy(hopper / "flash_attn_interface.py", out / "flash_attn_interface.py")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hopper", type=Path, required=True, help="a tar.gz of flash-attention's hopper/ directory")
    parser.add_argument("--cutlass", type=Path, required=True, help="a tar.gz of CUTLASS's include/ at flash-attention's pin")
    parser.add_argument("--out", type=Path, required=True, help="where the importable modules go")
    parser.add_argument("--head-dims", default="128", help=f"comma-separated, from {HEAD_DIMS}")
    parser.add_argument("--dtypes", default="bf16", help=f"comma-separated, from {DTYPES}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--no-decode-tiles", action="store_true", help="FA3's tiles as published (see DECODE_TILES_RULE)")
    args = parser.parse_args()
    head_dims, dtypes = [int(h) for h in args.head_dims.split(",")], args.dtypes.split(",")
    for name, values, allowed in (("--head-dims", head_dims, HEAD_DIMS), ("--dtypes", dtypes, DTYPES)):
        if bad := [v for v in values if v not in allowed]:
            parser.error(f"{name}: {bad} not in {list(allowed)}")
    build(args.hopper, args.cutlass, args.out, head_dims, dtypes, args.jobs, not args.no_decode_tiles)


if __name__ == "__main__":
    main()
