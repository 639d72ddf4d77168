"""Tokenizers: a model directory's ``tokenizer.json`` (``tokenizers`` library), or bytes for presets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, then BOS 256 and EOS 257 (the random-weight presets' vocabulary)."""

    eos_token_ids = (257,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library, chat template from ``tokenizer_config.json``."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as RustTokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = RustTokenizer.from_file(str(file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self._template = config.get("chat_template")
        self._specials = {k: config.get(k) for k in ("bos_token", "eos_token")}
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self._template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        import jinja2

        template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(self._template)
        specials = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in self._specials.items()}
        return template.render(messages=messages, add_generation_prompt=True, **specials)


def load_tokenizer(model: str, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The directory's tokenizer, or bytes when there is no ``tokenizer.json`` (presets)."""
    path = Path(model)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path, eos_token_ids)
    return ByteTokenizer()
