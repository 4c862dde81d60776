"""The tiny local checkpoints load with transformers, render chat, round-trip text and build once."""

import os
import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.tiny import VOCAB_SIZE, build_tiny


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny(kind, str(root / kind)) for kind in ("dense", "moe")}


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["dense"])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_loads_and_runs_with_transformers(tiny_dirs, kind):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[kind])
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[kind])
    assert model.config.vocab_size == len(tokenizer) == VOCAB_SIZE
    assert model.config.head_dim == 64
    assert model.config.tie_word_embeddings == (kind == "dense")
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    if kind == "moe":
        assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
    ids = tokenizer("What is 3 + 4? Answer with the number.", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE) and torch.isfinite(logits).all()


def test_chat_template(tokenizer):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_chat_template_tools(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "What is 3 + 4?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}],
        },
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert '{"name": "add", "parameters": {"type": "object"}}' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n7<|im_end|>\n"
    ) in text


def test_default_task_tokens_are_compact(tokenizer):
    # Digits are single tokens and the task's words are merged, so prompts stay short.
    assert len(tokenizer("What is 38 + 4? Answer with the number.").input_ids) <= 16
    assert tokenizer.convert_ids_to_tokens(tokenizer("1234").input_ids) == ["1", "2", "3", "4"]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=string.printable, max_size=200))
def test_byte_level_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < VOCAB_SIZE for i in ids)


def test_same_seed_same_checkpoint(tiny_dirs, tmp_path):
    for kind, first in tiny_dirs.items():
        second = build_tiny(kind, str(tmp_path / kind))
        a, b = load_file(os.path.join(first, "model.safetensors")), load_file(os.path.join(second, "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
        for name in ("tokenizer.json", "config.json", "chat_template.jinja"):
            with open(os.path.join(first, name)) as f, open(os.path.join(second, name)) as g:
                assert f.read() == g.read(), name


def test_second_build_is_a_no_op(tiny_dirs):
    path = tiny_dirs["dense"]
    weights = os.path.join(path, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert build_tiny("dense", path) == path
    assert os.stat(weights).st_mtime_ns == before
    assert sorted(os.listdir(os.path.dirname(path))) == ["dense", "moe"]  # no temp dirs left behind


def test_bad_kind_and_incomplete_dir(tmp_path):
    with pytest.raises(ValueError, match="model.tiny='huge'"):
        build_tiny("huge", str(tmp_path / "x"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="not a complete tiny checkpoint"):
        build_tiny("dense", str(tmp_path / "half"))
