"""Reading Hugging Face model directories: configs of both transformers generations, clear errors, tokenizers."""

from __future__ import annotations

import json

import pytest
import torch

from worker.config import ModelConfig
from worker.loader import build_model
from worker.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

BASE = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_rope_settings_from_either_config_generation():
    old = ModelConfig.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    new = ModelConfig.from_hf({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling["rope_type"] == new.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)


def test_the_long_context_preset_has_transformers_rope_frequencies():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from worker.config import PRESETS
    from worker.rope import inv_frequencies

    c = PRESETS["llama-3.1-8b"]
    hf = transformers.LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
                                  num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.max_position_embeddings,
                                  rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)
    inv, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert c.max_context == 131072 and scale == 1.0
    assert torch.equal(inv_frequencies(c), inv.float())


def test_unsupported_architecture_and_rope_are_named():
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' \(\['GPT2LMHeadModel'\]\)"):
        ModelConfig.from_hf({**BASE, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        build_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        build_model(str(tmp_path))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="lacks model.layers.0.self_attn.q_proj.weight"):
        build_model(str(tmp_path), torch.float32)
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        build_model(str(tmp_path / "nowhere"))


def test_dummy_load_format_builds_random_weights_at_the_directorys_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "max_position_embeddings": 128}))
    model = build_model(str(tmp_path), torch.float32, load_format="dummy")
    assert model.config == ModelConfig.from_hf(tmp_path) and model.config.num_kv_heads == 2
    again = build_model(str(tmp_path), torch.float32, load_format="dummy")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ValueError, match="load_format 'fake': choose 'auto' \\(the directory's weights\\) or 'dummy'"):
        build_model(str(tmp_path), load_format="fake")


def test_hf_tokenizer_and_chat_template(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}, "<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    loaded = load_tokenizer(str(tmp_path), eos_token_ids=(2,))
    assert isinstance(loaded, HFTokenizer) and loaded.eos_token_ids == (2,)
    assert loaded.encode("hello world") == [3, 4]
    assert loaded.decode([3, 4]) == "hello world"
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi</s>[assistant]"
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    # Current transformers saves the template as chat_template.jinja; it wins over tokenizer_config.json's.
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    bare = load_tokenizer(str(tmp_path))
    assert not bare.has_chat_template
    with pytest.raises(ValueError, match="this model has no chat template \\(neither chat_template.jinja nor"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no system') }}"}))
    with pytest.raises(ValueError, match="the chat template refused the messages: no system"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "system", "content": "hi"}])


def test_vanishing_temperature_and_top_p_still_draw_a_token():
    """(Found by the API sweep: temperature 5e-324 made logits / temperature inf and the worker's softmax NaN.)"""
    from worker.sampling import SamplingParams, noise_keys, sample

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for t in (5e-324, 1e-300, 1e-6):
        params = SamplingParams(temperature=t)
        assert params.greedy and int(logits.argmax()) == 1  # such rows never reach the sampler
    for p in (5e-324, 1e-30):  # a vanishing top_p keeps the likeliest token, never none
        assert sample(logits, [SamplingParams(top_p=p)], [noise_keys(1, 0, 0)]).tolist() == [1]