"""Hydra groups -> typed plan -> validator, and the `molt-run` dry run, with no Ray and no model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException

from molt.plan import CONF_DIR
from molt.plan import Plan, PlanError, to_plan
from molt.validate import validate
from runs import compose_plan

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {
    group: sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
    for group in ("model", "parallel", "rollout", "agent", "data", "estimator", "loss", "schedule", "trainer",
                  "experiment", "debug")
}


def test_groups_named_in_the_issue_exist():
    required = {
        "model": {"tiny", "tiny_moe", "qwen3_4b", "qwen35b_moe", "glm_753b_moe"},
        "parallel": {"cpu", "fsdp8", "ep64", "ep256"},
        "estimator": {"reinforce_pp", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae", "on_policy_distill"},
        "loss": {"ppo", "gspo", "cispo"},
        "schedule": {"sync", "async", "partial_rollout", "force_on_policy"},
    }
    for group, names in required.items():
        assert names <= set(GROUPS[group]), group


def test_default_plan_is_valid_and_typed():
    plan = compose_plan()
    assert isinstance(plan, Plan)
    assert (plan.model.name, plan.parallel.device, plan.estimator.name, plan.loss.name, plan.schedule.name) == (
        "tiny", "cpu", "reinforce_pp", "ppo", "async"
    )
    assert plan.schedule.queue_depth == 2 and plan.loss.importance_sampling.enabled
    assert validate(plan) == []


def test_group_choice_and_overrides_reach_the_plan():
    plan = compose_plan("model=qwen35b_moe", "parallel=ep64", "estimator=rloo", "trainer.lr=3e-6")
    assert plan.model.moe and plan.parallel.ep_size == 64 and plan.estimator.name == "rloo"
    assert plan.rollout.dtype == "bfloat16", "parallel=ep64 selects the GPU engine settings"
    assert plan.trainer.lr == pytest.approx(3e-6)
    assert validate(plan) == []


@pytest.mark.parametrize("recipe", GROUPS["experiment"])
def test_every_recipe_validates(recipe):
    plan = compose_plan(f"experiment={recipe}")
    assert plan.recipe == recipe
    assert validate(plan) == []


def composition_error(*overrides: str) -> str:
    """The message Hydra (at compose time) or to_plan (at conversion) gives for a bad override."""
    with pytest.raises((PlanError, HydraException)) as error:
        compose_plan(*overrides)
    return str(error.value) + str(error.value.__cause__ or "")


def test_unknown_key_names_its_full_path():
    assert "trainer.learning_rate" in composition_error("trainer.learning_rate=1")
    assert "trainer.learning_rate" in composition_error("+trainer.learning_rate=1")


def test_wrong_type_names_its_full_path():
    assert "trainer.steps" in composition_error("trainer.steps=many")
    assert "loss.importance_sampling.enabled" in composition_error("loss.importance_sampling.enabled=maybe")


def test_to_plan_rejects_bad_dicts_naming_the_key():
    with pytest.raises(PlanError, match=r"rollout\.top_p"):
        to_plan({"rollout": {"top_p": "high"}})
    with pytest.raises(PlanError, match=r"model\.nope"):
        to_plan({"model": {"nope": 1}})


# (bad overrides, overrides that fix them, key the message must name)
RULES = [
    (["schedule=partial_rollout", "rollout.seed_requests=true"], ["rollout.seed_requests=false"], "rollout.seed_requests"),
    (["logger.eval_every=-1"], ["logger.eval_every=10"], "logger.eval_every"),
    (["data.eval_size=0"], ["data.eval_size=8"], "data.eval_size"),
    (["schedule=partial_rollout", "loss.importance_sampling.enabled=false"], ["schedule=sync"], "schedule.partial_rollout"),
    (["schedule=async", "loss.importance_sampling.enabled=false"], ["schedule=sync"], "loss.importance_sampling.enabled"),
    (["rollout.top_p=0.9"], ["rollout.top_p=1.0"], "rollout.top_p"),
    (["rollout.top_k=20"], ["rollout.top_k=-1"], "rollout.top_k"),
    (["rollout.logprobs_mode=raw_logprobs", "rollout.temperature=0.7"], ["rollout.temperature=1.0"], "rollout.logprobs_mode"),
    (["estimator=grpo", "rollout.samples_per_prompt=1", "trainer.micro_batch_size=4"], ["rollout.samples_per_prompt=2"], "rollout.samples_per_prompt"),
    (["estimator=rloo", "rollout.samples_per_prompt=1", "trainer.micro_batch_size=4"], ["estimator=reinforce_pp"], "estimator=rloo"),
    (["estimator=dr_grpo", "rollout.samples_per_prompt=1", "trainer.micro_batch_size=4"], ["rollout.samples_per_prompt=4"], "estimator=dr_grpo"),
    (["estimator=reinforce_baseline", "rollout.samples_per_prompt=1", "trainer.micro_batch_size=4"], ["rollout.samples_per_prompt=4"], "samples_per_prompt"),
    (["dynamic_filter.enabled=true", "dynamic_filter.criterion=mean_bounds", "dynamic_filter.low=0.9", "dynamic_filter.high=0.1"], ["dynamic_filter.low=0.0", "dynamic_filter.high=1.0"], "dynamic_filter.low"),
    (["dynamic_filter.enabled=true", "dynamic_filter.criterion=mean_bounds", "dynamic_filter.low=0.5", "dynamic_filter.high=0.5"], ["dynamic_filter.criterion=zero_spread"], "dynamic_filter.high"),
    (["dynamic_filter.criterion=bogus"], ["dynamic_filter.criterion=mean_bounds"], "dynamic_filter.criterion"),
    (["dynamic_filter.enabled=true", "rollout.samples_per_prompt=1", "trainer.groups_per_step=32"], ["rollout.samples_per_prompt=2", "trainer.groups_per_step=16"], "dynamic_filter.enabled"),
    (["estimator=gae"], ["critic.enabled=true"], "critic.enabled"),
    (["critic.enabled=true"], ["estimator=gae"], "critic.enabled=true with estimator=reinforce_pp"),
    (["critic.enabled=true", "estimator=grpo"], ["critic.enabled=false"], "critic.enabled=true with estimator=grpo"),
    (["estimator=on_policy_distill"], ["reference.enabled=true"], "reference.enabled"),
    (["schedule=force_on_policy", "trainer.epochs_per_batch=2"], ["trainer.epochs_per_batch=1"], "trainer.epochs_per_batch"),
    (["schedule=force_on_policy", "schedule.queue_depth=2"], ["schedule.queue_depth=1"], "schedule.force_on_policy"),
    (["schedule=force_on_policy", "schedule.partial_rollout=true"], ["schedule.partial_rollout=false"], "schedule.partial_rollout=false"),
    (["schedule=force_on_policy", "schedule.refit_every=2"], ["schedule.refit_every=1"], "schedule.refit_every"),
    (["schedule=sync", "schedule.refit_every=2", "loss.importance_sampling.enabled=false"], ["loss.importance_sampling.enabled=true"], "schedule.refit_every=2"),
    (["loss.dual_clip=1.0"], ["loss.dual_clip=3.0"], "loss.dual_clip"),
    (["loss=gspo", "loss.dual_clip=3.0"], ["loss=ppo"], "loss.dual_clip"),
    (["loss=cispo", "loss.cispo_max_weight=0.5"], ["loss.cispo_max_weight=2.0"], "loss.cispo_max_weight"),
    (["loss.importance_sampling.level=bogus"], ["loss.importance_sampling.level=geo"], "loss.importance_sampling.level"),
    (["loss.importance_sampling.mode=bogus"], ["loss.importance_sampling.mode=trunc"], "loss.importance_sampling.mode"),
    (["parallel=fsdp8", "parallel.actor_ranks=6", "parallel.tp_size=4"], ["parallel.actor_ranks=8"], "parallel.actor_ranks"),
    (["parallel.ep_size=2", "parallel.actor_ranks=2"], ["model=tiny_moe"], "parallel.ep_size"),
    (["model=tiny_moe", "parallel.ep_size=2"], ["parallel.actor_ranks=2"], "parallel.ep_size"),
    (["parallel=fsdp8", "parallel.tp_size=4", "parallel.cp_size=2"], ["parallel.cp_size=1"], "context parallel is not wired"),
    (["model=tiny_moe", "parallel=cpu_ep2", "estimator=gae", "critic.enabled=true"], ["parallel.ep_size=1"], "critic.enabled=true with parallel.ep_size=2"),
    (["model=tiny_moe", "model.tiny=null", "model.multimodal=true", "parallel=cpu_ep2"], ["parallel.ep_size=1"], "model.multimodal=true with parallel.ep_size=2"),
    (["parallel=fsdp8", "parallel.pp_size=2"], ["parallel.pp_size=1"], "parallel.pp_size"),
    (["model.routing_replay=true"], ["model.routing_replay=false"], "model.routing_replay"),
    (["model.freeze_router=true"], ["model=tiny_moe"], "model.freeze_router"),
    (["model=tiny_moe", "loss.moe_aux_coef=-1"], ["loss.moe_aux_coef=0.01"], "loss.moe_aux_coef"),
    (["model=qwen35b_moe", "parallel=ep64", "model.routing_replay=true"], ["parallel.ep_size=1"], "parallel.ep_size=64"),
    (["model=qwen35b_moe", "parallel=ep64", "parallel.ep_size=1", "model.routing_replay=true", "schedule=partial_rollout"], ["schedule=async"], "schedule.partial_rollout"),
    (["model=tiny_moe", "model.routing_replay=true"], ["model.routing_replay=false"], "parallel.device=cpu"),
    (["trainer.groups_per_step=3", "rollout.samples_per_prompt=3", "trainer.micro_batch_size=2"], ["trainer.micro_batch_size=3"], "trainer.micro_batch_size"),
    (["parallel=fsdp8", "trainer.groups_per_step=1", "rollout.samples_per_prompt=4", "trainer.micro_batch_size=1"], ["trainer.groups_per_step=2"], "data-parallel size"),
    (["parallel.tp_size=2", "parallel.actor_ranks=2"], ["parallel.tp_size=1"], "parallel.tp_size"),
    (["rollout.tensor_parallel_size=2"], ["rollout.tensor_parallel_size=1"], "rollout.tensor_parallel_size"),
    (["rollout.weight_transfer=nccl"], ["rollout.weight_transfer=gloo"], "rollout.weight_transfer"),
    (["parallel=fsdp8", "rollout.engines=9"], ["rollout.engines=8"], "parallel.nodes"),
    (["agent=openai_chat", "data.apply_chat_template=false"], ["data.apply_chat_template=true"], "data.apply_chat_template"),
    (["loss.kl_coef=0.1"], ["reference.enabled=true"], "loss.kl_coef"),
    (["loss.kl_target=0.01"], ["loss.kl_coef=0.1", "reference.enabled=true"], "loss.kl_target"),
    (["estimator=grpo", "loss.kl_in_reward=true", "reference.enabled=true", "loss.kl_coef=0.1"], ["loss.kl_in_reward=false"], "loss.kl_in_reward"),
    (["loss.kl_estimator=k1", "reference.enabled=true", "loss.kl_coef=0.1"], ["loss.kl_estimator=k2"], "loss.kl_estimator=k1"),
    (["loss.kl_estimator=k1", "reference.enabled=true", "loss.kl_coef=0.1"], ["loss.kl_in_reward=true"], "loss.kl_in_reward=true"),
    (["loss.aggregation=token_sum"], ["loss.aggregation=seq_mean_token_mean"], "loss.aggregation"),
    (["loss.importance_sampling.seq_gate=[1.5,2.0]"], ["loss.importance_sampling.seq_gate=null"], "loss.importance_sampling.seq_gate"),
    (["loss.importance_sampling.seq_gate=[0.5]"], ["loss.importance_sampling.seq_gate=[0.5,2.0]"], "loss.importance_sampling.seq_gate"),
    (["loss.importance_sampling.low=1.5"], ["loss.importance_sampling.low=0.5"], "loss.importance_sampling.low"),
    (["loss.importance_sampling.high=0.5"], ["loss.importance_sampling.high=2.0"], "loss.importance_sampling.high"),
    (["loss.clip_low=1.5"], ["loss.clip_low=0.2"], "loss.clip_low"),
    (["loss=gspo", "loss.clip_high=-0.1"], ["loss.clip_high=0.0004"], "loss.clip_high"),
    (["trainer.betas=[0.9,1.0]"], ["trainer.betas=[0.9,0.99]"], "trainer.betas"),
    (["estimator.eps=0"], ["estimator.eps=1e-8"], "estimator.eps"),
    (["estimator.gamma=1.5"], ["estimator.gamma=0.99"], "estimator.gamma"),
    (["trainer.lr=-1"], ["trainer.lr=1e-5"], "trainer.lr"),
    (["trainer.steps=-3"], ["trainer.steps=3"], "trainer.steps"),
    (["trainer.micro_batch_size=0"], ["trainer.micro_batch_size=16"], "trainer.micro_batch_size"),
    (["rollout.engines=0"], ["rollout.engines=1"], "rollout.engines"),
    (["parallel.nodes=1000000"], ["parallel.nodes=1"], "parallel.nodes"),
    (["rollout.gpu_memory_utilization=1.5"], ["rollout.gpu_memory_utilization=0.5"], "rollout.gpu_memory_utilization"),
    (["model.tiny=big"], ["model.tiny=dense"], "model.tiny"),
    (["seed=-1"], ["seed=7"], "seed"),
    (["data.max_prompt_tokens=600"], ["data.max_prompt_tokens=64"], "rollout.max_model_len"),
    (["model.dtype=bfloat16"], ["model.dtype=float32"], "model.dtype"),
]


@pytest.mark.parametrize("bad,fix,key", RULES, ids=[rule[2] + "|" + ",".join(rule[0]) for rule in RULES])
def test_each_rule_fails_and_its_fix_passes(bad, fix, key):
    problems = validate(compose_plan(*bad))
    assert any(key in p for p in problems), problems
    assert validate(compose_plan(*bad, *fix)) == []


def test_all_violations_are_reported_at_once():
    problems = validate(compose_plan("estimator=gae", "rollout.top_p=0.5", "loss.dual_clip=0.5"))
    assert len(problems) == 3
    assert any("critic.enabled" in p for p in problems) and any("rollout.top_p" in p for p in problems)


def test_out_of_range_values_are_listed_together_without_computing_with_them():
    keys = ["trainer.lr=-1", "trainer.steps=-3", "loss.clip_low=1.5", "estimator.eps=0", "trainer.micro_batch_size=0"]
    problems = validate(compose_plan(*keys))  # micro_batch_size=0 once divided by zero in here
    assert len(problems) == len(keys), problems
    for override in keys:
        assert any(p.startswith(override.split("=")[0] + "=") for p in problems), (override, problems)


# Plans next to a rule's edge that must stay valid.
VALID = [
    ["dynamic_filter.enabled=true", "dynamic_filter.low=0.9", "dynamic_filter.high=0.1"],  # bounds unused by zero_spread
    ["estimator=on_policy_distill", "reference.enabled=true", "loss.kl_coef=0.1", "loss.kl_in_reward=true"],
    ["reference.enabled=true", "loss.kl_coef=0.1", "loss.kl_estimator=k1", "loss.kl_in_reward=true"],
    ["loss.kl_estimator=k1"],  # no KL term at all
    ["schedule=sync", "schedule.refit_every=2"],  # importance sampling is on by default
    ["schedule=force_on_policy"],
    ["estimator=gae", "critic.enabled=true"],
    ["loss.importance_sampling.seq_gate=null"],
    ["loss.importance_sampling.seq_gate=[1.0,1.0]"],
    ["rollout.top_k=0", "loss.clip_low=0", "trainer.grad_clip=0", "checkpoint.keep=0"],
]


@pytest.mark.parametrize("overrides", VALID, ids=[",".join(v) for v in VALID])
def test_plans_at_the_edge_of_a_rule_stay_valid(overrides):
    assert validate(compose_plan(*overrides)) == []


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from molt.cli import run; run()", *args, "hydra.run.dir=/tmp/molt-test-dry"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )


def test_dry_run_of_the_paper_scale_moe_prints_the_plan_without_ray(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the dry run checks that model.path is a checkpoint directory
    result = run_cli("model=qwen35b_moe", "parallel=ep64", "estimator=rloo", f"model.path={tmp_path}", "dry_run=true")
    assert result.returncode == 0, result.stderr
    assert "ep_size: 64" in result.stdout and "plan is valid" in result.stdout
    assert "ray" not in result.stderr.lower()


def test_invalid_launch_exits_nonzero_naming_keys_before_anything_starts():
    result = run_cli("estimator=gae", "rollout.top_p=0.9")
    assert result.returncode == 2
    assert "critic.enabled" in result.stderr and "rollout.top_p" in result.stderr
    assert "nothing was started" in result.stderr


def test_hydra_cfg_job_still_works():
    result = run_cli("--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "estimator:" in result.stdout


def test_actor_rank_threads_follow_the_schedule(monkeypatch):
    """Measured on 2 cores (README, Performance): a rank takes every core when generation and training take
    turns, and leaves the engine its core when they overlap."""
    from molt.placement import rank_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert rank_threads(compose_plan("schedule=sync")) == 8
    assert rank_threads(compose_plan("schedule=async")) == 7
    assert rank_threads(compose_plan("schedule=async", "rollout.engines=2", "parallel.actor_ranks=2")) == 3
    assert rank_threads(compose_plan("schedule=async", "trainer.cpu_threads=5")) == 5
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert rank_threads(compose_plan("schedule=async", "rollout.engines=2")) == 1  # never 0
