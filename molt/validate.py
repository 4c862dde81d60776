"""The config-time validator: one pure function from a plan to every unsupported combination in it.

Nothing here starts Ray or loads a model. Each message names the offending keys and the way out, so a
launch with a bad plan fails in seconds with the whole list instead of deep inside the loop.
"""

from __future__ import annotations

from molt.estimators import ESTIMATORS
from molt.losses import POLICY_LOSSES
from molt.placement import PlacementError, layout
from molt.plan import GROUP_ESTIMATORS, Plan

CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "parallel.device": ("cpu", "cuda"),
    "parallel.attention": ("sdpa", "flash", "te"),
    "rollout.dtype": ("float32", "bfloat16", "float16"),
    "rollout.logprobs_mode": ("processed_logprobs", "raw_logprobs"),
    "rollout.weight_transfer": ("auto", "nccl", "cpu"),
    "agent.form": ("env", "chat"),
    "data.bad_rows": ("error", "skip"),
    "loss.kl_estimator": ("k1", "k2", "k3"),
    "loss.importance_sampling.level": ("token", "seq", "geo"),
    "loss.importance_sampling.mode": ("mask", "clip", "trunc"),
    "trainer.lr_schedule": ("constant", "cosine", "linear"),
    "estimator.name": tuple(ESTIMATORS),
    "loss.name": tuple(POLICY_LOSSES),
}


def _value(plan: Plan, key: str):
    value = plan
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate(plan: Plan) -> list[str]:
    """Return one message per violation (empty when the plan can launch)."""
    problems = [
        f"{key}={_value(plan, key)!r} is not one of {', '.join(choices)}"
        for key, choices in CHOICES.items()
        if _value(plan, key) not in choices
    ]

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    m, par, ro, ag, est, loss, sch = (
        plan.model, plan.parallel, plan.rollout, plan.agent, plan.estimator, plan.loss, plan.schedule
    )
    isc = loss.importance_sampling
    dp = plan.data_parallel_size

    # Policy-version semantics: off-policy tokens need the per-token correction.
    need(
        isc.enabled or not (sch.partial_rollout or sch.queue_depth > 1),
        f"schedule.partial_rollout={sch.partial_rollout} / schedule.queue_depth={sch.queue_depth} train on "
        "tokens sampled by an older policy: set loss.importance_sampling.enabled=true (or schedule=sync)",
    )
    need(sch.queue_depth >= 1, "schedule.queue_depth must be >= 1 (1 = sync)")
    need(sch.refit_every >= 1, "schedule.refit_every must be >= 1")
    need(
        not (ro.seed_requests and sch.partial_rollout and par.device == "cpu"),
        "rollout.seed_requests=true with schedule.partial_rollout=true on CPU: vLLM-CPU stops the engine when "
        "it re-samples a seeded request after a refit (CPU Generator does not use offset); "
        "set rollout.seed_requests=false",
    )
    need(plan.logger.eval_every >= 0, f"logger.eval_every={plan.logger.eval_every}: use 0 (no eval) or a step count")
    need(plan.data.eval_size >= 1, f"data.eval_size={plan.data.eval_size}: the eval split needs at least one row")
    need(
        not isc.enabled or (ro.top_p == 1.0 and ro.top_k <= 0),
        f"loss.importance_sampling.enabled=true with rollout.top_p={ro.top_p} / rollout.top_k={ro.top_k}: "
        "truncated sampling changes the engine's log-probabilities away from the trainer's; "
        "set rollout.top_p=1.0 and rollout.top_k=-1",
    )
    need(
        ro.logprobs_mode == "processed_logprobs" or ro.temperature == 1.0,
        f"rollout.logprobs_mode=raw_logprobs with rollout.temperature={ro.temperature}: raw logprobs ignore "
        "the temperature the trainer applies; set rollout.logprobs_mode=processed_logprobs",
    )
    need(ro.temperature > 0, "rollout.temperature must be > 0 (log-probabilities of greedy decoding are undefined)")
    need(
        isc.low <= 1 <= isc.high,
        f"loss.importance_sampling.low={isc.low} / high={isc.high} must satisfy low <= 1 <= high",
    )

    # Estimators.
    need(
        est.name not in GROUP_ESTIMATORS or ro.samples_per_prompt >= 2,
        f"estimator={est.name} needs a group: rollout.samples_per_prompt={ro.samples_per_prompt} must be >= 2",
    )
    need(ro.samples_per_prompt >= 1, "rollout.samples_per_prompt must be >= 1")
    need(est.name != "gae" or plan.critic.enabled, "estimator=gae needs a critic: set critic.enabled=true")
    need(
        est.name != "on_policy_distill" or plan.reference.enabled,
        "estimator=on_policy_distill needs a teacher: set reference.enabled=true and reference.path",
    )
    need(
        len(est.reward_clip) == 2 and est.reward_clip[0] < est.reward_clip[1],
        f"estimator.reward_clip={est.reward_clip} must be [low, high] with low < high",
    )
    flt = plan.dynamic_filter
    if flt.enabled:
        need(flt.low < flt.high, f"dynamic_filter.low={flt.low} must be < dynamic_filter.high={flt.high}")
        need(
            ro.samples_per_prompt >= 2,
            "dynamic_filter.enabled=true filters on group scores: rollout.samples_per_prompt must be >= 2",
        )

    # KL: it must reach either the loss or the reward, and needs a reference model.
    need(
        loss.kl_coef == 0 or plan.reference.enabled,
        f"loss.kl_coef={loss.kl_coef} needs a reference model: set reference.enabled=true (or loss.kl_coef=0)",
    )
    need(
        not loss.kl_in_reward or est.name in ("reinforce_pp", "gae"),
        f"loss.kl_in_reward=true has no effect with estimator={est.name} (only reinforce_pp and gae add "
        "per-token rewards): set loss.kl_in_reward=false to apply KL as a loss term",
    )
    need(
        loss.kl_target is None or (loss.kl_target > 0 and loss.kl_coef > 0),
        f"loss.kl_target={loss.kl_target} steers loss.kl_coef={loss.kl_coef} multiplicatively: set loss.kl_coef > 0 "
        "(its starting value, with reference.enabled=true) and loss.kl_target > 0, or loss.kl_target=null",
    )

    # Policy losses.
    need(
        loss.dual_clip is None or loss.dual_clip > 1,
        f"loss.dual_clip={loss.dual_clip} must be > 1 (or null to disable)",
    )
    need(
        loss.dual_clip is None or loss.name == "ppo",
        f"loss.dual_clip is a PPO option; loss={loss.name} does not use it: set loss.dual_clip=null",
    )
    need(loss.cispo_max_weight >= 1, f"loss.cispo_max_weight={loss.cispo_max_weight} must be >= 1")
    need(loss.clip_low >= 0 and loss.clip_high >= 0, "loss.clip_low and loss.clip_high must be >= 0")

    # Schedules.
    if sch.force_on_policy:
        need(
            plan.trainer.epochs_per_batch == 1,
            f"schedule.force_on_policy=true maps one batch to one optimizer step: "
            f"trainer.epochs_per_batch={plan.trainer.epochs_per_batch} must be 1",
        )
        need(
            sch.queue_depth == 1 and not sch.partial_rollout,
            "schedule.force_on_policy=true needs schedule.queue_depth=1 and schedule.partial_rollout=false",
        )

    # Parallel layout.
    model_parallel = par.tp_size * par.cp_size * par.pp_size
    need(
        par.actor_ranks >= 1 and par.actor_ranks % model_parallel == 0,
        f"parallel.actor_ranks={par.actor_ranks} is not divisible by parallel.tp_size x cp_size x pp_size "
        f"= {model_parallel}",
    )
    need(par.pp_size == 1, f"parallel.pp_size={par.pp_size}: pipeline parallelism is not supported; use ep/tp/cp")
    need(
        par.ep_size == 1 or m.moe,
        f"parallel.ep_size={par.ep_size} on a dense model (model={m.name}): set parallel.ep_size=1",
    )
    need(not m.moe or m.num_experts >= 2, f"model.moe=true needs model.num_experts >= 2 (got {m.num_experts})")
    if m.moe:
        need(
            m.num_experts % par.ep_size == 0,
            f"parallel.ep_size={par.ep_size} does not divide model.num_experts={m.num_experts}",
        )
    need(
        (par.actor_ranks // (par.tp_size * par.pp_size)) % par.ep_size == 0,
        f"parallel.ep_size={par.ep_size} must divide the data x context parallel ranks "
        f"(parallel.actor_ranks / (tp_size x pp_size) = {par.actor_ranks // (par.tp_size * par.pp_size)})",
    )
    if par.device == "cpu" and par.ep_size > 1:
        # On CPU expert parallel runs AutoModel's native Qwen3-MoE (molt/trainer.py load_model), which has no
        # value-head variant for the critic.
        need(
            not plan.critic.enabled,
            f"critic.enabled=true with parallel.ep_size={par.ep_size} on parallel.device=cpu: the critic cannot "
            "use expert parallel on CPU; set parallel.ep_size=1 (or use parallel.device=cuda)",
        )
    need(
        par.cp_size == 1 or par.attention == "te",
        f"parallel.cp_size={par.cp_size} needs parallel.attention=te (context parallel attention)",
    )
    need(
        par.cp_size == 1,
        f"parallel.cp_size={par.cp_size}: context parallel is not wired into the trainer yet (it needs "
        "AutoModel's context-parallel batch sharding in the forward); use parallel.cp_size=1",
    )
    need(
        not (par.cp_size > 1 and par.sequence_packing),
        "parallel.sequence_packing=true with parallel.cp_size > 1: packed batches under context parallel are "
        "not supported; set parallel.sequence_packing=false",
    )

    need(
        ro.weight_transfer != "nccl",
        "rollout.weight_transfer=nccl: the trainer side of vLLM's NCCL weight transfer is not written yet; use "
        "auto (the weights travel through host memory, on GPU too)",
    )

    # Forward consistency: MoE routing and multimodal inputs.
    if m.routing_replay:
        need(
            not sch.partial_rollout,
            "model.routing_replay=true with schedule.partial_rollout=true: a request resumed on new weights "
            "mixes routes of two policies; use schedule=async",
        )
        need(
            par.device == "cuda",
            "model.routing_replay=true on parallel.device=cpu: vLLM-CPU cannot return routed experts (needs "
            "its model runner V2 with Triton); set model.routing_replay=false",
        )
    moe_features = [key for key, on in (("model.routing_replay", m.routing_replay),
                                         ("model.freeze_router", m.freeze_router),
                                         ("loss.moe_aux_coef", loss.moe_aux_coef != 0)) if on]
    need(loss.moe_aux_coef >= 0, f"loss.moe_aux_coef={loss.moe_aux_coef} must be >= 0")
    need(
        not moe_features or m.moe,
        f"{', '.join(moe_features)} need an MoE model (model={m.name} is dense); turn them off",
    )
    need(
        not moe_features or par.ep_size == 1,
        f"{', '.join(moe_features)} hook the HF MoE router, which AutoModel cannot shard with expert parallel: "
        f"with parallel.ep_size={par.ep_size} turn them off (or use parallel.ep_size=1)",
    )
    need(
        not (m.multimodal and par.sequence_packing),
        "model.multimodal=true with parallel.sequence_packing=true is not supported: set parallel.sequence_packing=false",
    )
    need(
        m.tiny is None or m.multimodal == (m.tiny == "vl"),
        f"model.tiny={m.tiny} with model.multimodal={m.multimodal}: only the tiny vision-language model "
        f"(model=tiny_vl) is multimodal",
    )
    need(
        not (m.tiny == "vl" and m.warm_start_steps),
        f"model.warm_start_steps={m.warm_start_steps} with model.tiny=vl: the warm start is a text task; set it to 0",
    )
    need(
        not (m.multimodal and plan.critic.enabled),
        "model.multimodal=true with critic.enabled=true: there is no value-head class for vision-language "
        "models; use a critic-free estimator (e.g. estimator=grpo)",
    )
    need(
        not (m.multimodal and par.device == "cpu" and par.ep_size != 1),
        f"model.multimodal=true with parallel.ep_size={par.ep_size} on parallel.device=cpu: expert parallel on CPU "
        f"shards AutoModel's native Qwen3-MoE only; use parallel.ep_size=1",
    )

    # Batch shapes.
    rollouts = plan.rollouts_per_step
    need(
        rollouts >= dp,
        f"trainer.groups_per_step x rollout.samples_per_prompt = {rollouts} rollouts is smaller than the "
        f"data-parallel size {dp}",
    )
    need(
        rollouts % (plan.trainer.micro_batch_size * dp) == 0,
        f"trainer.groups_per_step x rollout.samples_per_prompt = {rollouts} is not divisible by "
        f"trainer.micro_batch_size x data-parallel size = {plan.trainer.micro_batch_size} x {dp}",
    )
    need(plan.trainer.epochs_per_batch >= 1, "trainer.epochs_per_batch must be >= 1")
    need(
        plan.data.max_prompt_tokens + ag.max_tokens_per_turn <= ro.max_model_len,
        f"data.max_prompt_tokens + agent.max_tokens_per_turn = "
        f"{plan.data.max_prompt_tokens + ag.max_tokens_per_turn} exceeds rollout.max_model_len={ro.max_model_len}",
    )

    # Device and placement.
    if par.device == "cpu":
        for key in ("tp_size", "cp_size"):
            need(getattr(par, key) == 1, f"parallel.{key}={getattr(par, key)} needs GPUs; on parallel.device=cpu use 1")
        need(
            ro.tensor_parallel_size == 1 and ro.data_parallel_size == 1,
            "rollout.tensor_parallel_size / data_parallel_size > 1 need GPUs; on parallel.device=cpu use 1",
        )
        need(m.dtype == "float32", f"model.dtype={m.dtype} on CPU: use float32 so actor and engine logprobs agree")
    try:
        layout(plan)  # every rank and engine on a node of the plan, each engine whole
    except PlacementError as e:
        problems.append(str(e))

    # Agents and data.
    need(
        ag.form != "chat" or plan.data.apply_chat_template,
        f"agent.form=chat (agent={ag.name}) talks chat messages: set data.apply_chat_template=true",
    )
    need(ag.max_turns >= 1 and ag.max_tokens_per_turn >= 1, "agent.max_turns and agent.max_tokens_per_turn must be >= 1")
    need(0 <= ag.max_failure_fraction <= 1, "agent.max_failure_fraction must be within [0, 1]")
    return problems
