"""Incremental detokenization (``Tokenizer.detokenizer``): for any token sequence, the text it has returned after
each token is what ``decode`` gives for those tokens, short only of a token still waiting on the rest of a
character split over tokens (which ``decode`` shows as U+FFFD). Checked on bytes (the presets' tokenizer) and on two real ``tokenizer.json`` kinds
trained here: GPT-2's byte-level BPE and Llama 2's SentencePiece style (metaspace, byte fallback)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.tokenizer import ByteTokenizer, HFTokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog.", "naïve café, 東京 and Zürich — “quoted” ✓ 🙂",
          "def f(x):\n    return x ** 2  # squares", "streaming text a token at a time"] * 20


def trained(kind: str, tmp_path) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"] + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path / kind
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return HFTokenizer(path)


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def hf_tokenizer(request, tmp_path_factory):
    return trained(request.param, tmp_path_factory.mktemp("tok"))


def check_prefixes(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> None:
    detok, text = tokenizer.detokenizer(skip_special_tokens), ""
    for k, token in enumerate(ids, 1):
        text += detok.step(token)
        whole = tokenizer.decode(ids[:k], skip_special_tokens)
        assert whole.startswith(text), (ids[:k], text, whole)
        held = whole[len(text):]
        assert not held or "\ufffd" in held, (ids[:k], text, whole)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 257), max_size=40), st.booleans())
def test_bytes(ids, skip_special_tokens):
    check_prefixes(ByteTokenizer(), ids, skip_special_tokens)


def test_special_tokens_are_text_only_when_asked(tmp_path):
    assert ByteTokenizer().decode([104, 105, 257, 256]) == "hi"
    assert ByteTokenizer().decode([104, 105, 257, 0xE6, 256], skip_special_tokens=False) == "hi</s>\ufffd<s>"
    tok = trained("byte_level", tmp_path)
    ids = tok.encode("The quick fox") + [tok._tok.token_to_id("<eos>")]
    assert tok.decode(ids) == "The quick fox" and tok.decode(ids, skip_special_tokens=False) == "The quick fox<eos>"
    check_prefixes(tok, ids, skip_special_tokens=False)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_trained_tokenizers_on_random_ids(hf_tokenizer, data):
    vocab = hf_tokenizer._tok.get_vocab_size()
    check_prefixes(hf_tokenizer, data.draw(st.lists(st.integers(0, vocab - 1), max_size=30)))


@pytest.mark.parametrize("text", CORPUS[:4])
def test_trained_tokenizers_on_real_text(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text)
    check_prefixes(hf_tokenizer, ids)
    detok = hf_tokenizer.detokenizer()
    assert "".join(map(detok.step, ids)) == hf_tokenizer.decode(ids) == text


def test_a_tokenizer_and_chat_template_of_ones_own_replace_the_models(tmp_path):
    """vLLM's ``--tokenizer`` and ``--chat-template``: another directory's tokenizer.json; a template given as text
    or as a file; refusals that name the value."""
    from worker.tokenizer import load_tokenizer

    tok = trained("byte_level", tmp_path)
    directory = str(tmp_path / "byte_level")
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    got = load_tokenizer("tiny", tokenizer=directory, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert got.encode("The quick fox") == tok.encode("The quick fox")
    assert got.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a][b]"
    (tmp_path / "t.jinja").write_text("{{ messages | length }} {{ tools | length }}")
    got = load_tokenizer(directory, chat_template=str(tmp_path / "t.jinja"))
    assert got.apply_chat_template([{"role": "user", "content": "a"}], tools=[{"function": {"name": "f"}}]) == "1 1"
    with pytest.raises(ValueError, match="tokenizer '/nowhere' is no directory with a tokenizer.json"):
        load_tokenizer("tiny", tokenizer="/nowhere")
    with pytest.raises(ValueError, match="chat_template 'missing.jinja' is neither a Jinja template nor a file"):
        load_tokenizer(directory, chat_template="missing.jinja")
    with pytest.raises(ValueError, match="chat_template needs a model with a tokenizer.json; 'tiny' has the byte"):
        load_tokenizer("tiny", chat_template="{{ messages }}")


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_batch_encodes_each_text_as_alone(hf_tokenizer, add_special_tokens):
    texts = CORPUS[:4] + ["", "x"]
    for tokenizer in (hf_tokenizer, ByteTokenizer()):
        assert tokenizer.encode_batch(texts, add_special_tokens) == [tokenizer.encode(t, add_special_tokens)
                                                                     for t in texts]
        assert tokenizer.encode_batch([]) == []
