"""The config-time checks: every unsupported combination in a plan, listed at once, before anything starts.

`validate(plan)` is pure: it reads only the plan and the tables below. `check_inputs(plan)` does the checks that
need I/O (agent module, data files, checkpoints) and starts nothing. Each message names its keys and the way out.
"""

from __future__ import annotations

import json
import os
from functools import reduce

from molt.agent import FORMS, load_agent
from molt.console import LIBRARY_LOGS
from molt.data import DataError, parse_line, read_lines, validate_row
from molt.estimators import (CRITIC_ESTIMATORS, ESTIMATORS, FILTER_CRITERIA, GROUP_ESTIMATORS,
                             KL_REWARD_ESTIMATORS, TEACHER_ESTIMATORS)
from molt.losses import AGGREGATIONS, IS_LEVELS, IS_MODES, KL_ESTIMATORS, POLICY_LOSSES
from molt.models import ATTENTION
from molt.placement import PlacementError, layout
from molt.plan import Plan
from molt.ranks import LR_SCHEDULES
from molt.tiny import KINDS

# key -> the values it takes. Lists owned by a module are read from it; the rest are the plan's own.
CHOICES = {
    "model.tiny": (None, *KINDS),  # None = a user checkpoint
    "model.dtype": ("float32", "bfloat16"),
    "parallel.device": ("cpu", "cuda"),
    "parallel.attention": tuple(ATTENTION),
    "rollout.dtype": ("float32", "bfloat16", "float16"),
    "rollout.logprobs_mode": ("processed_logprobs", "raw_logprobs"),
    # auto: NCCL between GPUs, else gloo through host memory (molt/refit.py refit_backend); gloo: always
    # through host memory. No "nccl": auto takes it wherever it can work (two ranks on one GPU cannot).
    "rollout.weight_transfer": ("auto", "gloo"),
    "agent.form": tuple(FORMS),
    "data.bad_rows": ("error", "skip"),
    "estimator.name": tuple(ESTIMATORS),
    "loss.name": tuple(POLICY_LOSSES),
    "loss.aggregation": AGGREGATIONS,
    "loss.kl_estimator": KL_ESTIMATORS,
    "loss.importance_sampling.level": IS_LEVELS,
    "loss.importance_sampling.mode": IS_MODES,
    "dynamic_filter.criterion": FILTER_CRITERIA,
    "trainer.lr_schedule": LR_SCHEDULES,
    "logger.library_logs": LIBRARY_LOGS,
}

# key -> the interval its value must lie in: "[" and "]" include the bound, "(" and ")" exclude it, so
# "(0, inf)" is any positive finite number. A null (None) value of an Optional key means "off" and is allowed.
MAX_COUNT = "65536"  # nodes, ranks and engines: far above any cluster, and keeps the pure layout() instant
RANGES = {
    "model.warm_start_steps": "[0, inf)",
    "parallel.nodes": f"[1, {MAX_COUNT}]",
    "parallel.gpus_per_node": "[0, inf)",
    "parallel.actor_ranks": f"[1, {MAX_COUNT}]",
    "parallel.tp_size": "[1, inf)",
    "parallel.cp_size": "[1, inf)",
    "parallel.ep_size": "[1, inf)",
    "parallel.pp_size": "[1, inf)",
    "rollout.engines": f"[1, {MAX_COUNT}]",
    "rollout.tensor_parallel_size": "[1, inf)",
    "rollout.data_parallel_size": "[1, inf)",
    "rollout.gpu_memory_utilization": "(0, 1]",
    "rollout.kv_cache_gib": "(0, inf)",
    "rollout.max_model_len": "[1, inf)",
    "rollout.samples_per_prompt": "[1, inf)",
    "rollout.temperature": "(0, inf)",  # log-probabilities of greedy decoding are undefined
    "rollout.top_p": "(0, 1]",
    "rollout.top_k": "[-1, inf)",  # -1 or 0 = off
    "rollout.cpu_reserved_cores": "[0, inf)",
    "rollout.cpu_onednn_cache_capacity": "[0, inf)",  # 0: no cache
    "rollout.refit_timeout_s": "(0, inf)",
    "agent.max_turns": "[1, inf)",
    "agent.max_tokens_per_turn": "[1, inf)",
    "agent.timeout_s": "(0, inf)",
    "agent.max_failure_fraction": "[0, 1]",
    "data.eval_size": "[1, inf)",
    "data.max_prompt_tokens": "[1, inf)",
    "estimator.gamma": "[0, 1]",
    "estimator.lam": "[0, 1]",
    "estimator.eps": "(0, inf)",  # whitening divides by std + eps: 0 gives NaN on a batch of equal rewards
    "estimator.distill_coef": "(0, inf)",
    "loss.clip_low": "[0, 1)",  # the ratio's lower bound 1 - clip_low must stay positive
    "loss.clip_high": "[0, 1)",
    "loss.dual_clip": "(1, inf)",
    "loss.cispo_max_weight": "[1, inf)",
    "loss.kl_coef": "[0, inf)",
    "loss.kl_target": "(0, inf)",
    "loss.kl_horizon": "[1, inf)",
    "loss.entropy_coef": "[0, inf)",
    "loss.moe_aux_coef": "[0, inf)",
    "loss.value_clip": "(0, inf)",
    "loss.importance_sampling.low": "(0, 1]",
    "loss.importance_sampling.high": "[1, inf)",
    "loss.importance_sampling.max_staleness": "[0, inf)",
    "schedule.queue_depth": "[1, inf)",  # 1 = sync
    "schedule.refit_every": "[1, inf)",
    "dynamic_filter.low": "(-inf, inf)",  # any finite reward
    "dynamic_filter.high": "(-inf, inf)",
    "critic.lr": "(0, inf)",
    "trainer.steps": "[1, inf)",
    "trainer.groups_per_step": "[1, inf)",
    "trainer.micro_batch_size": "[1, inf)",
    "trainer.epochs_per_batch": "[1, inf)",
    "trainer.lr": "(0, inf)",
    "trainer.warmup_steps": "[0, inf)",
    "trainer.weight_decay": "[0, inf)",
    "trainer.grad_clip": "[0, inf)",  # 0 = no clipping
    "trainer.cpu_threads": "[1, inf)",
    "trainer.cpu_nice": "[0, 19]",
    "checkpoint.every": "[0, inf)",  # 0 = only at the end
    "checkpoint.keep": "[0, inf)",  # 0 = keep all
    "logger.eval_every": "[0, inf)",  # 0 = never
    "seed": "[0, 4294967295]",  # vLLM seeds numpy, which takes 32 bits
}


def _value(plan: Plan, key: str):
    return reduce(getattr, key.split("."), plan)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _within(value, interval: str) -> bool:
    """Whether the number `value` lies in `interval`, written as in RANGES ("(0, 1]"); NaN never does."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value > low if interval[0] == "(" else value >= low
    below = value < high if interval[-1] == ")" else value <= high
    return above and below


def _finite_pair(values) -> bool:
    return (isinstance(values, (list, tuple)) and len(values) == 2
            and all(_number(v) and _within(v, "(-inf, inf)") for v in values))


def validate(plan: Plan) -> list[str]:
    """Return one message per violation (empty when the plan can launch)."""
    problems: list[str] = []
    bad: set[str] = set()  # keys whose own value is wrong; rules that compute with them are skipped

    for key, choices in CHOICES.items():
        value = _value(plan, key)
        if value not in choices:
            bad.add(key)
            listing = ", ".join("null" if c is None else str(c) for c in choices)
            problems.append(f"{key}={value!r} is not one of {listing}")
    for key, interval in RANGES.items():
        value = _value(plan, key)
        if value is not None and not (_number(value) and _within(value, interval)):
            bad.add(key)
            problems.append(f"{key}={value!r} is out of range: use a value in {interval}")

    def need(holds: bool, message: str) -> None:
        if not holds:
            problems.append(message)

    def ok(*keys: str) -> bool:
        """All of `keys` hold values in range, so a rule may compute with them."""
        return not bad.intersection(keys)

    m, par, ro, ag, est = plan.model, plan.parallel, plan.rollout, plan.agent, plan.estimator
    loss, sch, flt, tr = plan.loss, plan.schedule, plan.dynamic_filter, plan.trainer
    isc = loss.importance_sampling

    # Pairs.
    need(
        _finite_pair(est.reward_clip) and est.reward_clip[0] < est.reward_clip[1],
        f"estimator.reward_clip={est.reward_clip} must be [low, high] with low < high",
    )
    need(
        _finite_pair(tr.betas) and all(0 <= b < 1 for b in tr.betas),
        f"trainer.betas={tr.betas} must be [beta1, beta2], each in [0, 1) (Adam's moment decays)",
    )
    need(
        isc.seq_gate is None or (_finite_pair(isc.seq_gate) and 0 < isc.seq_gate[0] <= 1 <= isc.seq_gate[1]),
        f"loss.importance_sampling.seq_gate={isc.seq_gate} must be [low, high] with 0 < low <= 1 <= high "
        "(a sequence whose geometric-mean weight is 1 always passes), or null for no gate",
    )

    # Policy versions: tokens sampled by older weights need the per-token correction.
    stale = [key for key, on in (("schedule.partial_rollout=true", sch.partial_rollout),
                                 (f"schedule.queue_depth={sch.queue_depth}", sch.queue_depth > 1),
                                 (f"schedule.refit_every={sch.refit_every}", sch.refit_every > 1)) if on]
    need(
        isc.enabled or not stale,
        f"{' / '.join(stale)} train on tokens sampled by older weights: set loss.importance_sampling.enabled=true "
        "(or schedule=sync with schedule.refit_every=1)",
    )
    need(
        not sch.force_on_policy or (sch.queue_depth, sch.partial_rollout, sch.refit_every, tr.epochs_per_batch)
        == (1, False, 1, 1),
        "schedule.force_on_policy=true trains each batch once, on the weights that sampled it: it needs "
        f"schedule.queue_depth=1, schedule.partial_rollout=false, schedule.refit_every=1 and "
        f"trainer.epochs_per_batch=1 (got {sch.queue_depth}, {str(sch.partial_rollout).lower()}, {sch.refit_every}, "
        f"{tr.epochs_per_batch})",
    )
    need(
        not (ro.seed_requests and sch.partial_rollout and par.device == "cpu"),
        "rollout.seed_requests=true with schedule.partial_rollout=true on CPU: vLLM-CPU stops the engine when it "
        "re-samples a seeded request after a refit (its CPU Generator has no offset); set rollout.seed_requests=false",
    )
    need(
        not isc.enabled or (ro.top_p == 1.0 and ro.top_k <= 0),
        f"loss.importance_sampling.enabled=true with rollout.top_p={ro.top_p} / rollout.top_k={ro.top_k}: truncated "
        "sampling changes the engine's log-probabilities away from the trainer's; set rollout.top_p=1.0 and top_k=-1",
    )
    need(
        ro.logprobs_mode == "processed_logprobs" or ro.temperature == 1.0,
        f"rollout.logprobs_mode=raw_logprobs with rollout.temperature={ro.temperature}: raw logprobs ignore "
        "the temperature the trainer applies; set rollout.logprobs_mode=processed_logprobs",
    )

    # Estimators: what each needs is declared next to it (molt/estimators.py).
    grouped = [key for key, on in ((f"estimator={est.name}", est.name in GROUP_ESTIMATORS),
                                   ("dynamic_filter.enabled=true", flt.enabled)) if on]
    need(
        not grouped or ro.samples_per_prompt >= 2,
        f"{' and '.join(grouped)} score groups: rollout.samples_per_prompt={ro.samples_per_prompt} must be >= 2",
    )
    need(
        est.name not in CRITIC_ESTIMATORS or plan.critic.enabled,
        f"estimator={est.name} needs a critic: set critic.enabled=true",
    )
    if ok("estimator.name"):
        need(
            not plan.critic.enabled or est.name in CRITIC_ESTIMATORS,
            f"critic.enabled=true with estimator={est.name}, which reads no values: the critic would have no "
            f"returns to learn; set critic.enabled=false (or estimator={' / '.join(sorted(CRITIC_ESTIMATORS))})",
        )
        need(
            not loss.kl_in_reward or est.name in KL_REWARD_ESTIMATORS,
            f"loss.kl_in_reward=true has no effect with estimator={est.name} (per-token rewards reach only "
            f"{', '.join(sorted(KL_REWARD_ESTIMATORS))}): set loss.kl_in_reward=false to apply KL as a loss term",
        )
    need(
        est.name not in TEACHER_ESTIMATORS or plan.reference.enabled,
        f"estimator={est.name} needs a teacher: set reference.enabled=true and reference.path",
    )
    need(
        not flt.enabled or flt.criterion != "mean_bounds" or flt.low < flt.high,
        f"dynamic_filter.criterion=mean_bounds keeps groups with a mean reward inside (low, high): "
        f"dynamic_filter.low={flt.low} must be < dynamic_filter.high={flt.high}",
    )

    # KL: it must reach either the loss or the reward, and needs a reference model.
    need(
        loss.kl_coef == 0 or plan.reference.enabled,
        f"loss.kl_coef={loss.kl_coef} needs a reference model: set reference.enabled=true (or loss.kl_coef=0)",
    )
    need(
        not (loss.kl_estimator == "k1" and loss.kl_coef > 0 and not loss.kl_in_reward),
        "loss.kl_estimator=k1 as a loss term (loss.kl_coef > 0, loss.kl_in_reward=false) has zero expected "
        "gradient: use loss.kl_estimator=k2 or k3, or loss.kl_in_reward=true",
    )
    need(
        loss.kl_target is None or loss.kl_coef > 0,
        f"loss.kl_target={loss.kl_target} steers loss.kl_coef={loss.kl_coef} multiplicatively: set loss.kl_coef > 0 "
        "(its starting value, with reference.enabled=true), or loss.kl_target=null",
    )

    # Policy losses.
    need(
        loss.dual_clip is None or loss.name == "ppo",
        f"loss.dual_clip is a PPO option; loss={loss.name} does not use it: set loss.dual_clip=null",
    )

    # Parallel layout.
    parallel_sizes = ("parallel.actor_ranks", "parallel.tp_size", "parallel.cp_size", "parallel.ep_size",
                      "parallel.pp_size")
    if ok(*parallel_sizes):
        model_parallel = par.tp_size * par.cp_size * par.pp_size
        need(
            par.actor_ranks % model_parallel == 0,
            f"parallel.actor_ranks={par.actor_ranks} is not divisible by parallel.tp_size x cp_size x pp_size "
            f"= {model_parallel}",
        )
        dp_cp = par.actor_ranks // (par.tp_size * par.pp_size)
        need(
            dp_cp % par.ep_size == 0,
            f"parallel.ep_size={par.ep_size} must divide the data x context parallel ranks "
            f"(parallel.actor_ranks / (tp_size x pp_size) = {dp_cp})",
        )
    need(par.pp_size == 1, f"parallel.pp_size={par.pp_size}: pipeline parallelism is not supported; use ep/tp/cp")
    need(
        par.ep_size == 1 or m.moe,
        f"parallel.ep_size={par.ep_size} on a dense model (model={m.name}): set parallel.ep_size=1",
    )
    # On CPU expert parallel runs AutoModel's native Qwen3-MoE (molt/models.py load_model): no value head, no vision.
    cpu_ep_blocked = [key for key, on in (("critic.enabled=true", plan.critic.enabled),
                                          ("model.multimodal=true", m.multimodal)) if on]
    need(
        not (cpu_ep_blocked and par.device == "cpu" and par.ep_size > 1),
        f"{' and '.join(cpu_ep_blocked)} with parallel.ep_size={par.ep_size} on parallel.device=cpu: expert "
        "parallel on CPU shards AutoModel's native Qwen3-MoE only; set parallel.ep_size=1 (or parallel.device=cuda)",
    )
    need(
        par.cp_size == 1,
        f"parallel.cp_size={par.cp_size}: context parallel is not wired into the trainer yet (it needs AutoModel's "
        "context-parallel batch sharding in the forward, and parallel.attention=te); use parallel.cp_size=1",
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

    # Batch shapes.
    if ok(*parallel_sizes, "trainer.groups_per_step", "rollout.samples_per_prompt", "trainer.micro_batch_size"):
        rollouts, dp = plan.rollouts_per_step, plan.actor_dp_size
        need(  # also refuses fewer rollouts than data-parallel ranks
            rollouts % (tr.micro_batch_size * dp) == 0,
            f"trainer.groups_per_step x rollout.samples_per_prompt = {rollouts} is not divisible by "
            f"trainer.micro_batch_size x data-parallel size = {tr.micro_batch_size} x {dp}",
        )
    need(
        plan.data.max_prompt_tokens + ag.max_tokens_per_turn <= ro.max_model_len,
        f"data.max_prompt_tokens + agent.max_tokens_per_turn = "
        f"{plan.data.max_prompt_tokens + ag.max_tokens_per_turn} exceeds rollout.max_model_len={ro.max_model_len}",
    )

    # Device and placement.
    if par.device == "cpu":
        gpu_sizes = [f"{key}={_value(plan, key)}" for key in ("parallel.tp_size", "rollout.tensor_parallel_size",
                                                              "rollout.data_parallel_size") if _value(plan, key) != 1]
        need(not gpu_sizes, f"{', '.join(gpu_sizes)} need GPUs; on parallel.device=cpu set them to 1")
        need(m.dtype == "float32", f"model.dtype={m.dtype} on CPU: use float32 so actor and engine logprobs agree")
    if ok("parallel.device", "parallel.nodes", "parallel.gpus_per_node", "parallel.actor_ranks", "rollout.engines",
          "rollout.tensor_parallel_size", "rollout.data_parallel_size"):
        try:
            layout(plan)  # every rank and engine on a node of the plan, each engine whole
        except PlacementError as e:
            problems.append(str(e))

    # Agents.
    need(
        ag.form != "chat" or plan.data.apply_chat_template,
        f"agent.form=chat (agent={ag.name}) talks chat messages: set data.apply_chat_template=true",
    )
    return problems


DATA_ROWS_CHECKED = 8  # first rows of a data file checked before launch; the loop checks every row as it reads


def check_inputs(plan: Plan) -> list[str]:
    """The checks that read files or import code, one message per problem: the agent module and its AgentRunner's
    form, the first rows of the data files, user checkpoints, and parallel.ep_size against the model's experts."""
    problems = []
    ag, module = plan.agent, None
    if ag.form in FORMS:  # else validate() reports agent.form
        try:
            module = load_agent(ag.path, ag.form)
        except Exception as e:  # the user's module may raise anything on import
            problems.append(
                f"agent.path={ag.path} does not load ({type(e).__name__}: {e}); it must name a module (dotted "
                f"name or .py file) exporting AgentRunner, a molt.agent.{FORMS[ag.form].__name__} for "
                f"agent.form={ag.form}"
            )
    for split in ("train", "eval"):
        key = f"data.{split}_path"
        path = _value(plan, key)
        used = split == "train" or plan.logger.eval_every > 0  # eval rows are read only to evaluate
        if path is not None and (problem := _data_file_problem(path, plan.data.bad_rows)):
            problems.append(f"{key}={path}: {problem}")
        elif path is None and used and module is not None and not hasattr(module, "dataset"):
            problems.append(f"{key} is not set and agent module {ag.path} has no dataset(split, size, seed): "
                            f"set {key} to a JSONL file")

    checkpoints = [("model.path", plan.model.path)] if plan.model.tiny is None else []  # a tiny one is built
    if plan.reference.enabled and plan.reference.path is not None:
        checkpoints.append(("reference.path", plan.reference.path))
    for key, path in checkpoints:
        if not os.path.isfile(os.path.join(path, "config.json")):
            where = "no such directory" if not os.path.isdir(path) else "the directory has no config.json"
            problems.append(f"{key}={path}: {where}; set {key} to a Hugging Face checkpoint directory")
    experts, ep = _num_experts(plan.model.path), plan.parallel.ep_size
    if experts and ep > 1 and experts % ep:
        problems.append(f"parallel.ep_size={ep} does not divide the {experts} experts per layer of model.path="
                        f"{plan.model.path} (its config.json): set parallel.ep_size to a divisor of {experts}")
    return problems


def _num_experts(path: str) -> int | None:
    """Routed experts per MoE layer named by the checkpoint's config.json (or its text_config), if any."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):  # no checkpoint there yet (reported above, or a tiny one is built)
        return None
    for section in (config, config.get("text_config")) if isinstance(config, dict) else ():
        for key in ("num_experts", "n_routed_experts"):  # Qwen MoE, GLM / DeepSeek MoE
            if isinstance(section, dict) and type(section.get(key)) is int:
                return section[key]
    return None


def _data_file_problem(path: str, bad_rows: str) -> str | None:
    """What is wrong with the JSONL file at `path`, judged on its first rows with molt/data.py's row checks."""
    try:
        lines = read_lines(path)
    except DataError as e:
        return f"{e}; set it to a JSONL file of chat rows (or null for the agent's built-in task)"
    if not lines:
        return "the file has no rows; each line is a JSON object with 'messages' (molt/data.py)"
    errors = []
    for number, line in lines[:DATA_ROWS_CHECKED]:
        where = f"row {number}"
        try:
            validate_row(parse_line(line, where), where)
        except DataError as e:
            errors.append(str(e))
    if errors and bad_rows == "error":
        return f"{errors[0]}; fix the row (or set data.bad_rows=skip)"
    if len(errors) == min(len(lines), DATA_ROWS_CHECKED):  # with data.bad_rows=skip one usable row will do
        return f"none of the first {len(errors)} rows has the chat format ({errors[0]}); fix the file"
    return None
