"""Tokenizers: a model directory's ``tokenizer.json`` (``tokenizers`` library), or bytes for presets."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Protocol


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str:
        """The text ``token_id`` adds to the tokens stepped so far: "" while it waits on the next token (part
        of a character); what it has returned, joined, is a prefix of ``decode`` of those tokens."""


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, in order; a tokenizer that can lets go of the GIL meanwhile (a server tokenizes
        on a thread of its own while its event loop serves the other requests)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        """A fresh incremental decoder: a sequence's text a token at a time, not all of it again each step."""

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, then BOS 256 and EOS 257 (the random-weight presets' vocabulary); the ids above
    are no text."""

    eos_token_ids = (257,)
    SPECIAL = {256: "<s>", 257: "</s>"}
    has_chat_template = True  # a toy one: "<role>content" lines

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        detok = _ByteDetokenizer(False)
        return "".join(map(detok.step, ids)) + detok.rest()

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        return _ByteDetokenizer(skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        listed = f"<tools>{','.join(t['function']['name'] for t in tools)}\n" if tools else ""  # names: a toy's context is short
        return listed + "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each id's bytes: a byte for 0..255, the specials' names, the unused ids' placeholders."""
        names = {**self.SPECIAL, **{i: f"<unused{i}>" for i in range(258, vocab_size)}}
        return [bytes((i,)) if i < 256 else names[i].encode() for i in range(vocab_size)]


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library; the chat template from ``chat_template.jinja``
    (where current transformers saves it) or else ``tokenizer_config.json``."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = RustTokenizer.from_file(str(file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        self._template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(self._template, list):  # several named templates: the default one
            self._template = next((t["template"] for t in self._template if t.get("name") == "default"), None)
        if chat_template is not None:  # the caller's, over the model's
            self._template = chat_template
        self.has_chat_template = bool(self._template)
        self._specials = {k: config.get(k) for k in ("bos_token", "eos_token")}
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        # The library's batch call runs without the GIL (its single ``encode`` holds it throughout)
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        return _StreamDetokenizer(self._tok, skip_special_tokens)

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (for a grammar library to read its vocabulary)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not self._template:
            raise ValueError("this model has no chat template (neither chat_template.jinja nor a chat_template in "
                             "tokenizer_config.json): send completions instead")
        import datetime

        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ValueError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
        try:
            template = env.from_string(self._template)
        except jinja2.TemplateError as exc:
            raise ValueError(f"this model's chat template does not parse: {exc}") from None
        specials = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in self._specials.items()}
        try:
            return template.render(messages=messages, tools=tools, add_generation_prompt=True, **specials)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template failed on these messages: {exc}") from None


class _ByteDetokenizer:
    def __init__(self, skip_special_tokens: bool = True):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip_special_tokens

    def step(self, token_id: int) -> str:
        if token_id < 256:
            return self._utf8.decode(bytes((token_id,)))
        if self._skip or token_id not in ByteTokenizer.SPECIAL:
            return ""
        return self._utf8.decode(b"", final=True) + ByteTokenizer.SPECIAL[token_id]  # a split character ends here

    def rest(self) -> str:
        """What a character cut short at the end decodes to (U+FFFD), as ``decode`` shows it."""
        return self._utf8.decode(b"", final=True)


class _StreamDetokenizer:
    """``tokenizers``' own incremental decoder (it holds back bytes of a character split over tokens)."""

    def __init__(self, tok, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


def load_tokenizer(model: str, eos_token_ids: tuple[int, ...] = (), tokenizer: str | None = None,
                   chat_template: str | None = None) -> Tokenizer:
    """The directory's tokenizer (``tokenizer``'s where given: vLLM's ``--tokenizer``), or bytes when there is no
    ``tokenizer.json`` (presets). ``chat_template``: a Jinja template, or a file holding one, instead of the
    model's (vLLM's ``--chat-template``); a ``ValueError`` for a tokenizer that cannot take one."""
    path = Path(tokenizer if tokenizer is not None else model)
    if tokenizer is not None and not (path / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {tokenizer!r} is no directory with a tokenizer.json")
    template = chat_template
    if chat_template is not None and "{" not in chat_template:
        if not Path(chat_template).is_file():
            raise ValueError(f"chat_template {chat_template!r} is neither a Jinja template nor a file")
        template = Path(chat_template).read_text()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path, eos_token_ids, template)
    if chat_template is not None:
        raise ValueError(f"chat_template needs a model with a tokenizer.json; {model!r} has the byte tokenizer")
    return ByteTokenizer()
