"""The chat data path: one dataset format for both agent forms, and the one place messages become tokens.

A dataset row is a dict in the OpenAI chat format:

    {"messages": [{"role": "user", "content": "What is 3 + 4?"}],   # required
     "tools": [{"type": "function", "function": {...}}],          # optional, OpenAI tool schemas
     "label": 7}                                                  # optional, anything the agent grades with

Images (model.multimodal=true) are content parts of a message, as the OpenAI format has them:
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`, or from Python code
`{"type": "image", "image": <PIL.Image>}`. Nothing is fetched: a URL that is not a data URL is refused.
A normalized message keeps its text with IMAGE where each image sat and the decoded images under "images".
The engine expands each IMAGE token into the model's image tokens; the trace keeps the expanded ids and the
image tensors the actor's forward needs (`Conversation.add_turn`).

Rows come from a JSONL file (`data.train_path` / `data.eval_path`) or from the agent module's
`dataset(split, size, seed)`. The chat template is applied exactly once to build what the engine sees:
here for an `Env` (`load_dataset` stores each row's `prompt_ids`), by the chat server for a `ChatAgent`.
Both call `render_prompt` on the same normalized messages, so both forms send the engine identical ids.

`Conversation` grows a rollout's token trace request by request: the model's sampled ids are kept as
they are and only messages added since are rendered and appended.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import re
import sys
from typing import Any, Optional

from jinja2 import TemplateError
from PIL import Image

from molt.plan import Plan
from molt.trace import Sample, Trajectory

ROW_FIELDS = ("messages", "tools", "label")
ROLES = ("system", "user", "assistant", "tool")
# The tiny model's (and Qwen's) tool-call format: a JSON object inside <tool_call> tags in the reply text.
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Where an image sits in a message's text: the placeholder token of Idefics3-family processors (molt/tiny.py).
IMAGE = "<image>"
MAX_IMAGE_PIXELS = 4096 * 4096  # larger images are refused before they are decoded


class DataError(ValueError):
    """A dataset row or chat request that does not have the chat format; the message names the field."""


def normalize_messages(messages: Any, where: str) -> list[dict]:
    """OpenAI-format chat messages -> the plain form the chat template reads.

    Content becomes one string (IMAGE where an image part was; the decoded images under "images"),
    tool-call arguments become dicts, and fields the template does not use are dropped, so the same
    conversation normalizes to the same value whichever client sent it.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of chat messages")
    normalized = []
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{at}.role is {role!r}; use one of {', '.join(ROLES)}")
        text, images = _content(message.get("content"), f"{at}.content")
        out = {"role": role, "content": text}
        if images:
            out["images"] = images
        if role == "assistant" and message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise DataError(f"{at}.tool_calls must be a list of tool calls")
            out["tool_calls"] = [
                _tool_call(call, f"{at}.tool_calls[{j}]") for j, call in enumerate(message["tool_calls"])
            ]
        if role == "tool" and message.get("tool_call_id") is not None:
            out["tool_call_id"] = str(message["tool_call_id"])
        normalized.append(out)
    return normalized


def _content(content: Any, where: str) -> tuple[str, list[Image.Image]]:
    """Message content -> (text with IMAGE at each image, the images)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise DataError(f"{where} must be a string or a list of text and image parts")
    texts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text", ""), str):
                raise DataError(f"{where}[{j}].text must be a string")
            texts.append(part.get("text", ""))
        elif kind in ("image_url", "image"):
            images.append(_image(part, f"{where}[{j}]"))
            texts.append(IMAGE)
        else:
            raise DataError(f"{where}[{j}] must be a text part, an image_url part with a data URL, or an image part")
    return "".join(texts), images


def _image(part: dict, where: str) -> Image.Image:
    """An image part -> an RGB image. Only data URLs are read: nothing is fetched or opened."""
    if part["type"] == "image":
        if not isinstance(part.get("image"), Image.Image):
            raise DataError(f"{where}: an 'image' part needs a PIL image under 'image'")
        return part["image"].convert("RGB")
    url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
    header, _, data = url.partition(",") if isinstance(url, str) else ("", "", "")
    if not (header.startswith("data:image/") and header.endswith(";base64")):
        raise DataError(f"{where}: image_url.url must be a data URL (data:image/...;base64,...); nothing is fetched")
    try:
        with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:  # read from the header, before decoding
                raise DataError(f"{where}: the image is {image.width}x{image.height}, over {MAX_IMAGE_PIXELS} pixels")
            return image.convert("RGB")
    except DataError:
        raise
    except Exception as e:  # PIL's decoders raise many kinds of errors (OSError, SyntaxError, ...) on bad bytes
        raise DataError(f"{where}: the data URL is not a readable image ({type(e).__name__})") from None


def image_data_url(image: Image.Image) -> str:
    """`image` as a PNG data URL, the form image parts carry in JSONL rows and chat requests."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def message_images(messages: list[dict]) -> list[Image.Image]:
    """The images of normalized messages, in order: the order of IMAGE in their rendering."""
    return [image for message in messages for image in message.get("images", ())]


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where} must look like {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise DataError(f"{where}.function.arguments is not valid JSON: {arguments[:80]!r}") from None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}.function.arguments must be a JSON object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def normalize_tools(tools: Any, where: str) -> Optional[list[dict]]:
    """OpenAI tool schemas, rebuilt with a fixed key order (the template prints them as JSON)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of tool schemas")
    normalized = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(
                f"{where}: tools[{i}] must look like {{'type': 'function', 'function': {{'name': ..., "
                f"'description': ..., 'parameters': {{...}}}}}}"
            )
        kept = {key: function[key] for key in ("name", "description", "parameters") if key in function}
        normalized.append({"type": "function", "function": kept})
    return normalized


def validate_row(row: Any, where: str) -> tuple[list[dict], Optional[list[dict]]]:
    """The row's normalized messages and tools; a DataError naming the row and field unless `row` has the
    dataset format."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object with 'messages'")
    unknown = sorted(set(row) - set(ROW_FIELDS))
    if unknown:
        raise DataError(
            f"{where}: unknown field {unknown[0]!r}; a row has {', '.join(ROW_FIELDS)} (task data goes in 'label')"
        )
    messages = normalize_messages(row.get("messages"), where)
    if not any(message["content"].strip() or message.get("tool_calls") for message in messages):
        raise DataError(f"{where}: field 'messages': every message is empty; a prompt needs some text")
    return messages, normalize_tools(row.get("tools"), where)


def render(tokenizer, messages: list[dict], tools: Optional[list[dict]], add_generation_prompt: bool,
           chat_template: bool = True) -> str:
    """Normalized messages -> prompt text. Without a chat template (base models) the contents are joined.
    A conversation the template refuses, or text the tokenizer cannot take, is a DataError."""
    try:
        if not chat_template:
            text = "".join(message["content"] for message in messages)
        else:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        text.encode("utf-8")  # a lone surrogate (the JSON escape "\ud800") would fail inside the tokenizer
    except TemplateError as e:  # the template's raise_exception, e.g. on a role order it does not accept
        raise DataError(f"the chat template refused the messages: {e}") from None
    except UnicodeEncodeError:
        raise DataError("the messages are not valid unicode (a lone surrogate such as \\ud800)") from None
    return text


@functools.lru_cache(maxsize=4)
def template_closing(tokenizer, chat_template: bool = True) -> str:
    """What the template writes after an assistant message's content (ChatML: "<|im_end|>\n"). Rendered once
    per tokenizer (its template does not change during a run), not once per rollout: on short answers the
    render was a third of the driver's busy time."""
    probe = "MOLT-PROBE"
    text = render(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}], None, False,
                  chat_template)
    if probe not in text:
        raise ValueError("the chat template drops assistant messages; Molt cannot continue a conversation with it")
    return text[text.rindex(probe) + len(probe):]


def render_prompt(tokenizer, messages: list[dict], tools: Optional[list[dict]],
                  chat_template: bool = True) -> list[int]:
    """The engine prompt for a conversation: the chat template with the generation prompt, tokenized."""
    text = render(tokenizer, messages, tools, add_generation_prompt=True, chat_template=chat_template)
    return encode(tokenizer, text, len(message_images(messages)))


def encode(tokenizer, text: str, num_images: int) -> list[int]:
    """Prompt text -> ids, each IMAGE one token. Where IMAGE is a special token (a vision-language model),
    text that spells it would claim an image that is not there (or take one that is): a DataError."""
    if IMAGE in tokenizer.all_special_tokens and text.count(IMAGE) != num_images:
        raise DataError(f"the text contains {text.count(IMAGE) - num_images} literal {IMAGE} beyond its "
                        f"{num_images} image parts; {IMAGE} is reserved for images")
    return tokenizer.encode(text, add_special_tokens=False)


def load_processor(plan: Plan):
    """The model's HF processor when model.multimodal (it turns images into the actor's tensors), else None."""
    if not plan.model.multimodal:
        return None
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(plan.model.path)
    if getattr(processor, "image_token", None) != IMAGE:
        raise ValueError(
            f"model.path={plan.model.path}: its processor ({type(processor).__name__}) marks images with "
            f"{getattr(processor, 'image_token', None)!r}; Molt's messages mark them with {IMAGE!r} "
            f"(Idefics3/SmolVLM-family processors)"
        )
    return processor


def image_inputs(processor, images: list[Image.Image]) -> dict[str, Any]:
    """The actor's image tensors for one sequence's images: the processor's output for a batch of one
    ([images, ...] each: pixel_values, pixel_attention_mask for Idefics3)."""
    return {name: value[0] for name, value in processor.image_processor(images=[images], return_tensors="pt").items()}


def load_dataset(plan: Plan, agent_module, tokenizer, split: str, size: int) -> list[dict]:
    """The validated rows of `split` ("train" or "eval").

    Read from data.train_path / data.eval_path when set (row N = line N of the file), else `size` rows from
    the agent module's `dataset(split, size, seed)`. For an Env each row gets `prompt_ids`, its rendered
    prompt; a ChatAgent's rows stay as they are (the chat server renders what the agent sends). A bad row
    (not JSON, wrong format, an empty prompt, or one over data.max_prompt_tokens) is an error naming the row
    and field, or with data.bad_rows=skip it is skipped and the skipped rows are counted on stderr.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: use 'train' or 'eval'")
    path = plan.data.train_path if split == "train" else plan.data.eval_path
    if path is not None:
        numbered, source = read_lines(path), path
    elif hasattr(agent_module, "dataset"):
        numbered = list(enumerate(agent_module.dataset(split, size, plan.seed), start=1))
        source = f"{agent_module.__name__}.dataset"
    else:
        raise DataError(
            f"data.{split}_path is not set and agent module {agent_module.__name__} has no dataset(split, size, "
            f"seed): set data.{split}_path to a JSONL file"
        )
    chat_template = plan.data.apply_chat_template
    kept, skipped = [], []
    for number, row in numbered:
        where = f"{source} row {number}"
        try:
            if isinstance(row, bytes):  # a line of the JSONL file
                row = parse_line(row, where)
            messages, tools = validate_row(row, where)  # images decoded once
            if message_images(messages) and not plan.model.multimodal:
                raise DataError(f"{where}: field 'messages' has images, but model={plan.model.name} is not "
                                f"multimodal (model.multimodal=false); use a vision-language model")
            try:
                prompt_ids = render_prompt(tokenizer, messages, tools, chat_template)
            except DataError as e:
                raise DataError(f"{where}: field 'messages': {e}") from None
            if len(prompt_ids) > plan.data.max_prompt_tokens:
                raise DataError(
                    f"{where}: field 'messages' renders to {len(prompt_ids)} prompt tokens, over "
                    f"data.max_prompt_tokens={plan.data.max_prompt_tokens}"
                )
        except DataError as e:
            if plan.data.bad_rows == "skip":
                skipped.append(str(e))
                continue
            raise
        kept.append({**row, "prompt_ids": prompt_ids} if plan.agent.form == "env" else row)
    if skipped:
        print(f"molt: data: skipped {len(skipped)} of {len(numbered)} rows of {source} (data.bad_rows=skip); "
              f"the first: {skipped[0]}", file=sys.stderr, flush=True)
    if not kept:
        raise DataError(f"{source}: no usable rows for split {split!r}")
    return kept


def read_lines(path: str) -> list[tuple[int, bytes]]:
    """The non-blank lines of a JSONL file with their line numbers."""
    try:
        with open(path, "rb") as f:
            return [(number, line) for number, line in enumerate(f, start=1) if line.strip()]
    except OSError as e:
        raise DataError(f"cannot read dataset file {path}: {e.strerror}") from None


def parse_line(line: bytes, where: str) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8 text") from None
    except ValueError as e:  # invalid JSON, or a number too long to convert
        raise DataError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply") from None


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split a reply into its text and its tool calls (normalized form, ids not yet assigned).

    A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a block that is not such JSON
    stays in the text, as the model wrote it.
    """
    calls = []

    def take(match: re.Match) -> str:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return match.group(0)
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}})
        return ""

    text = TOOL_CALL.sub(take, text)
    return text.strip(), calls


class Conversation:
    """One rollout's token trace, grown one engine request at a time from chat messages.

    A request whose messages extend the messages the current segment stands for reuses the segment's exact
    ids: only the new messages are rendered and appended. Any other request (the agent compacted or
    rewrote its history, changed its tools, or the template re-renders earlier turns) seals the segment and
    starts a new one from a fresh rendering. All segments share the rollout id.
    """

    def __init__(self, tokenizer, rollout_id: str, group_id: str, chat_template: bool = True, processor=None):
        self.tokenizer = tokenizer
        self.processor = processor  # load_processor(plan): None for a text-only model
        self.rollout_id = rollout_id
        self.group_id = group_id
        self.chat_template = chat_template
        self.segments: list[Trajectory] = []
        # The current segment as the engine is sent it: one IMAGE token per image, where the segment's
        # token_ids hold the engine's expansion of each. The same ids for a text-only conversation.
        self.engine_ids: list[int] = []
        self.messages: list[dict] = []  # what the current segment's ids stand for, ending with the last reply
        self.tools: Optional[list[dict]] = None
        self.tail = ""  # template text after the last reply that the model did not sample (ChatML: "\n")
        self.closing = template_closing(tokenizer, chat_template)

    def _render(self, messages, tools, add_generation_prompt) -> str:
        return render(self.tokenizer, messages, tools, add_generation_prompt, self.chat_template)

    def prompt_for(self, messages: list[dict], tools: Optional[list[dict]]) -> list[int]:
        """The engine prompt for a request carrying these normalized messages and tools; its images are
        `message_images(messages)`."""
        if message_images(messages) and self.processor is None:
            raise DataError("the messages have images, but the model is not multimodal (model.multimodal=false)")
        n = len(self.messages)
        if self.segments and tools == self.tools and messages[:n] == self.messages:
            before = self._render(self.messages, tools, False)
            after = self._render(messages, tools, True)
            if after.startswith(before):
                new = self.tail + after[len(before):]
                return self.engine_ids + encode(self.tokenizer, new, len(message_images(messages[n:])))
        return render_prompt(self.tokenizer, messages, tools, self.chat_template)

    def continues(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt extends the current segment (else the context was compacted: a new segment)."""
        return bool(self.segments) and prompt_ids[: len(self.engine_ids)] == self.engine_ids

    def routes_known(self, prompt_ids: list[int]) -> int:
        """How many of the prompt's positions have their MoE routes in the trace already: the engine need not
        return them again."""
        return len(self.segments[-1].routed_experts) if self.continues(prompt_ids) else 0

    def add_turn(self, messages: list[dict], tools: Optional[list[dict]], prompt_ids: list[int],
                 sample: Sample, reply: dict) -> None:
        """Record one engine call: its prompt (from `prompt_for`), the sample, and the reply message."""
        segment = self.segments[-1] if self.continues(prompt_ids) else None
        if segment is None:
            segment = Trajectory(self.rollout_id, self.group_id, segment=len(self.segments))
            self.segments.append(segment)
        # The engine's rendering: each image's IMAGE token expanded into the model's image tokens.
        rendered = prompt_ids if sample.prompt_ids is None else sample.prompt_ids
        if rendered[: len(segment.token_ids)] != segment.token_ids:
            raise AssertionError(f"rollout {self.rollout_id}: the engine rendered the earlier turns' images "
                                 f"differently from the trace")
        segment.add_context(rendered[len(segment.token_ids):])
        segment.add_action(sample)
        images = message_images(messages)
        if images:  # all of the segment's images, in the order of their tokens
            segment.multimodal = image_inputs(self.processor, images)
        self.engine_ids = prompt_ids + sample.token_ids
        self.messages = messages + [reply]
        self.tools = tools
        # A reply that ended on the end-of-turn token already holds the start of the template's closing.
        stop = self.tokenizer.decode(sample.token_ids[-1:]) if sample.finish_reason == "stop" else ""
        self.tail = self.closing[len(stop):] if stop and self.closing.startswith(stop) else self.closing
