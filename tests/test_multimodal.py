"""Vision-language policies through the same loop: image parts in messages, the engine's expansion of each
image into the model's image tokens, the image tensors in the trace, and the actor's forward on them.

The model is the tiny Idefics3 (model=tiny_vl, molt/tiny.py); the task is molt/agents/colors.py.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from molt.agent import run_chat_rollout, run_env_rollout
from molt.agents import colors, colors_anthropic, colors_openai
from molt.chat_protocols import RequestError, _from_anthropic
from molt.data import (
    IMAGE,
    Conversation,
    DataError,
    image_data_url,
    load_dataset,
    load_processor,
    message_images,
    normalize_messages,
)
from molt.generator import Generator
from molt.chat_server import ChatServer
from molt.loop import train
from molt.step import refit
from molt.plan import AgentPlan, ModelPlan, Plan, RolloutPlan
from molt.tiny import _build_tokenizer, build_tiny
from molt.trace import Trajectory, collate
from molt.trainer import Trainer
from molt.validate import validate
from runs import compose_plan, steps_log, valid_plan

RED = image_data_url(colors.image("red"))


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return build_tiny("vl", str(tmp_path_factory.mktemp("models") / "tiny-vl"))


def vl_plan(path: str, agent: str = "colors", form: str = "env") -> Plan:
    return Plan(model=ModelPlan(name="tiny_vl", tiny="vl", path=path, multimodal=True, warm_start_steps=0),
                rollout=RolloutPlan(max_model_len=256),
                agent=AgentPlan(path=f"molt.agents.{agent}", form=form, max_turns=2, max_tokens_per_turn=8))


# ---- messages and the trace, no engine ----------------------------------------------------------------


def test_image_parts_become_image_tokens_and_decoded_images():
    messages = normalize_messages([{"role": "user", "content": [image_part(RED), {"type": "text", "text": "Hi"}]}], "t")
    assert messages[0]["content"] == f"{IMAGE}Hi"
    (image,) = message_images(messages)
    assert image.size == (32, 32) and image.getpixel((0, 0)) == colors.COLORS["red"]
    # the same image from Python code normalizes to the same message
    assert normalize_messages([{"role": "user", "content": [{"type": "image", "image": colors.image("red")},
                                                             {"type": "text", "text": "Hi"}]}], "t") == messages


@pytest.mark.parametrize("part, message", [
    (image_part("https://example.com/cat.png"), "t: messages[0].content[0]: image_url.url must be a data URL"),
    (image_part("data:image/png;base64,bm90IGFuIGltYWdl"), "content[0]: the data URL is not a readable image"),
    (image_part("data:image/png;base64,%%%"), "content[0]: the data URL is not a readable image"),
    (image_part(RED[:120]), "content[0]: the data URL is not a readable image"),  # a truncated PNG
    (image_part(image_data_url(Image.new("1", (5000, 4000)))), "content[0]: the image is 5000x4000, over"),
    ({"type": "image", "image": "cat.png"}, "content[0]: an 'image' part needs a PIL image"),
    ({"type": "input_audio"}, "content[0] must be a text part, an image_url part with a data URL, or an image part"),
])
def test_bad_image_parts_name_the_part(part, message):
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")):
        normalize_messages([{"role": "user", "content": [part]}], "t")


def test_text_spelling_the_image_token_is_refused(vl_path):
    conversation = Conversation(AutoTokenizer.from_pretrained(vl_path), "r", "g", processor=object())
    messages = normalize_messages([{"role": "user", "content": [image_part(RED), {"type": "text", "text": IMAGE}]}], "t")
    with pytest.raises(DataError, match=f"1 literal {IMAGE} beyond its 1 image parts"):
        conversation.prompt_for(messages, None)


def test_a_text_model_refuses_images_and_keeps_the_literal_text(vl_path):
    conversation = Conversation(AutoTokenizer.from_pretrained(vl_path), "r", "g")  # no processor: text only
    with pytest.raises(DataError, match="the model is not multimodal"):
        conversation.prompt_for(normalize_messages([{"role": "user", "content": [image_part(RED)]}], "t"), None)
    text_only = _build_tokenizer()  # the tiny text models' tokenizer: IMAGE is plain text there
    prompt = Conversation(text_only, "r", "g").prompt_for([{"role": "user", "content": f"Write {IMAGE}"}], None)
    assert f"Write {IMAGE}" in text_only.decode(prompt)


def test_anthropic_image_blocks_become_data_url_parts():
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": RED.split(",")[1]}}
    (message,) = _from_anthropic({"role": "user", "content": [block, {"type": "text", "text": "Hi"}]}, "m")
    assert message["content"] == [image_part(RED), {"type": "text", "text": "Hi"}]
    with pytest.raises(RequestError, match="needs a base64 source"):
        _from_anthropic({"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}, "m")
    with pytest.raises(RequestError, match="'image' block in a assistant message is not supported"):
        _from_anthropic({"role": "assistant", "content": [block]}, "m")


def test_collate_pads_images_with_all_zero_images():
    with_two = Trajectory("a", "g", token_ids=[1, 2], action_mask=[False, True], logprobs=[0.0, -1.0], versions=[-1, 0],
                          engine_outputs=[[2]],
                          multimodal={"pixel_values": torch.ones(2, 3, 4, 4), "pixel_attention_mask": torch.ones(2, 4, 4)})
    text_only = Trajectory("b", "g", token_ids=[3], action_mask=[False], logprobs=[0.0], versions=[-1])
    batch = collate([with_two, text_only])
    assert batch.pixel_values.shape == (2, 2, 3, 4, 4) and batch.pixel_attention_mask.shape == (2, 2, 4, 4)
    assert batch.pixel_values[0].eq(1).all() and batch.pixel_values[1].eq(0).all()
    assert collate([text_only]).pixel_values is None


def test_validator_rejects_unsupported_multimodal_combinations():
    assert validate(compose_plan("model=tiny_vl", "agent=colors")) == []
    for overrides, key in [
        (["model=tiny_vl", "estimator=gae", "critic.enabled=true"], "model.multimodal=true with critic.enabled=true"),
        (["model=tiny_vl", "model.multimodal=false"], "model.tiny=vl with model.multimodal=False"),
        (["model=tiny_vl", "model.warm_start_steps=10"], "model.warm_start_steps=10 with model.tiny=vl"),
        (["model=tiny_vl", "model.routing_replay=true"], "model.routing_replay=true on parallel.device=cpu"),
    ]:
        problems = validate(compose_plan(*overrides))
        assert any(key in problem for problem in problems), (overrides, problems)


def test_load_dataset_keeps_images_for_a_multimodal_model(vl_path):
    plan = vl_plan(vl_path)
    rows = load_dataset(plan, colors, AutoTokenizer.from_pretrained(vl_path), "train", size=3)
    image_token = AutoTokenizer.from_pretrained(vl_path).convert_tokens_to_ids(IMAGE)
    assert all(row["prompt_ids"].count(image_token) == 1 for row in rows)  # the engine expands it


# ---- the real engine and actor ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl(local_ray, loop, vl_path):
    plan = vl_plan(vl_path)
    generator = loop.run_until_complete(Generator.start(plan))
    processor = load_processor(plan)
    server = ChatServer(generator, processor.tokenizer, plan, processor)
    loop.run_until_complete(server.start())
    trainer = Trainer(plan)
    yield plan, generator, processor, server, trainer
    trainer.shutdown()
    loop.run_until_complete(server.stop())
    loop.run_until_complete(generator.shutdown())


@pytest.mark.slow
def test_env_and_chat_rollouts_with_images_match_the_actor(vl, loop):
    plan, generator, processor, server, trainer = vl
    tokenizer = processor.tokenizer
    image_token = tokenizer.convert_tokens_to_ids(IMAGE)
    per_image = processor.image_seq_len
    row = load_dataset(plan, colors, tokenizer, "train", size=1)[0]

    # An Env: the row's image, then a second one shown with the observation.
    (env,) = loop.run_until_complete(run_env_rollout(colors.ColorsEnv, row, generator, tokenizer, plan, "env", "g",
                                                     processor))
    assert len(env.engine_outputs) == 2
    assert env.token_ids.count(image_token) == 2 * per_image  # each image expanded by the engine
    assert env.multimodal["pixel_values"].shape == (2, 3, 32, 32)

    # ChatAgents: the same row through the openai SDK (image_url part) and the anthropic SDK (base64 block).
    chat_row = {k: v for k, v in row.items() if k != "prompt_ids"}
    chats = [loop.run_until_complete(run_chat_rollout(agent.AgentRunner, chat_row, server, plan, name, "g"))[0]
             for name, agent in (("openai", colors_openai), ("anthropic", colors_anthropic))]
    prompt = env.token_ids[: env.action_mask.index(True)]
    for chat in chats:
        assert chat.token_ids[: len(prompt)] == prompt  # both SDKs and the Env give the engine the same input
        assert chat.multimodal["pixel_values"].shape == (1, 3, 32, 32)

    batch = collate([env, *chats])
    actor = trainer.logprobs(batch, plan.rollout.temperature)
    mask = batch.action_mask
    assert (actor - batch.rollout_logprobs)[mask].abs().max() < 1e-4  # float32 engine and actor agree

    # The actor really reads the images: other images give other log-probabilities.
    swapped = collate([env, *chats])
    swapped.pixel_values = -swapped.pixel_values  # padding images stay all zero
    assert (trainer.logprobs(swapped, plan.rollout.temperature) - actor)[mask].abs().max() > 1e-3

    # Refit: one step moves the actor, its weights reach the engine through the trainer's broadcast.
    trainer.train_step(batch, torch.where(mask, 1.0, 0.0), actor, mask)
    assert (trainer.logprobs(batch, plan.rollout.temperature) - actor)[mask].abs().max() > 1e-3
    loop.run_until_complete(refit(generator, trainer, version=1, keep_requests=False))
    (after,) = loop.run_until_complete(run_env_rollout(colors.ColorsEnv, row, generator, tokenizer, plan, "env-1",
                                                       "g", processor))
    new = collate([after])
    engine_vs_actor = (trainer.logprobs(new, plan.rollout.temperature) - new.rollout_logprobs)[new.action_mask]
    assert engine_vs_actor.abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("agent", ["colors", "colors_anthropic"])
def test_vision_language_agents_train_through_the_loop(agent, tmp_path):
    plan = valid_plan("model=tiny_vl", f"agent={agent}", "trainer.steps=2", "trainer.groups_per_step=2",
                      "rollout.samples_per_prompt=2", "trainer.micro_batch_size=4", "logger=console")
    summary = train(plan, str(tmp_path))
    records = steps_log(tmp_path)
    assert summary["steps"] == 2 and records[0]["rollout/samples"] == 4
    assert records[0]["mismatch/abs_max"] < 1e-3  # the loop's own engine-vs-actor check, images included
