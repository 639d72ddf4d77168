"""Writing benchmark results: a printed table plus bench/results/<name>.json with where and how it ran."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch
from tabulate import tabulate

RESULTS = Path(__file__).resolve().parent / "results"


def environment(device: str | None = None) -> dict:
    """Device, date, versions and command line of this run. ``device`` named by the caller: CUDA is left alone (a
    process that must hold no device memory while others run), and the kernels' versions with it."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("cuda-bindings", "ray", "vattn"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device is None and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
        versions["cuda"] = torch.version.cuda
        for module in ("flash_attn", "flash_attn_3", "flashinfer"):  # attention kernels, often built on the machine
            try:
                imported = importlib.import_module(module)
                versions[module] = imported.__version__
                if getattr(imported, "vattn_decode_tiles", False):  # tools/build_fa3.py's decode tiles
                    versions[module] += " (decode tiles)"
            except Exception:  # not there, or not importable: the backends that need it say so
                pass
    elif device is None:
        device = f"cpu ({platform.processor() or platform.machine()})"
    return {
        "device": device,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def tree_env(tree: Path) -> dict[str, str]:
    """This process's environment with ``tree`` first on ``PYTHONPATH``: a child process that runs a source tree's code
    (another tree's, in an A/B) imports from it before whatever else is on the path."""
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}


def write(name: str, headers: list[str], rows: list[list], data: dict, out_dir: Path = RESULTS) -> Path:
    """Print ``rows`` as a table and save it with ``data`` and the environment as ``<name>.json``."""
    print(tabulate(rows, headers=headers, floatfmt=".3f"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {**environment(), "table": {"headers": headers, "rows": rows}, **data}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def generated_tokens(outputs, max_tokens: int | None = None) -> int:
    """The tokens ``outputs`` (vattn ``RequestOutput``s) generated, once every request is seen to have run whole:
    none failed (a worker group rebuilt mid-run ends the requests in flight with an error, and their missing
    tokens would pass for speed) and, with ``max_tokens``, each completion reached it (EOS ignored)."""
    failed = [o for o in outputs if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed; the first: {failed[0].error}")
    if max_tokens is not None:
        for o in outputs:
            for c in o.outputs:
                if len(c.token_ids) != max_tokens:
                    raise RuntimeError(f"request {o.request_id} ended after {len(c.token_ids)} of {max_tokens} "
                                       f"tokens (finish_reason {c.finish_reason!r})")
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)
