"""The trainer: FSDP2-sharded policy (or reference) ranks on Ray, and the driver-side `Trainer` that uses them.

Each rank is a `PolicyWorker` Ray actor that owns one shard of the model (NeMo AutoModel's device mesh and
parallelizer), recomputes log-probabilities for the exact token ids of a trace, takes optimizer steps and
writes distributed checkpoints. `Trainer` creates the ranks, splits a `TrainBatch` across the data-parallel
ranks and gathers the results; the training loop only talks to `Trainer`.

One loss denominator: every loss term is a sum over loss tokens divided by the number of loss tokens in the
whole batch, and gradients are summed over micro-batches and ranks, so the update does not depend on how many
ranks or micro-batches the batch is split into.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from typing import Iterator, Optional

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from molt import losses, routing
from molt.placement import rank_resources, rank_threads
from molt.plan import Plan, TrainerPlan
from molt.trace import IMAGE_INPUTS, TrainBatch

CHECKPOINT_PREFIX = "step_"
COMPLETE_MARKER = "extra.json"  # written last, just before the atomic rename
LR_SCHEDULES = ("constant", "cosine", "linear")
ATTENTION = {"sdpa": "sdpa", "flash": "flash_attention_2", "te": "te"}  # parallel.attention -> AutoModel's name


def load_model(plan: Plan, path: str, value_head: bool = False):
    """Load the HF checkpoint at `path` and shard it with FSDP2 (+ tp/ep from plan.parallel).

    Returns (model, mesh): the parallelized model and AutoModel's MeshContext. Call on every rank after
    torch.distributed is initialised. This is the one place where CPU and GPU differ; on CPU expert parallel
    uses AutoModel's native Qwen3-MoE class, everything else the HF classes (*ForImageTextToText for
    model.multimodal). With value_head the model is the same backbone with a new scalar head per token (HF's
    *ForTokenClassification): a critic.
    AutoModel is imported here, in the ranks, so that the driver does not pay for it.
    """
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes

    p = plan.parallel
    if p.pp_size != 1 or p.cp_size != 1:
        raise ValueError(
            f"parallel.pp_size={p.pp_size}, parallel.cp_size={p.cp_size}: the trainer supports FSDP2 with tensor "
            f"and expert parallel only; set both to 1"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"model path {path} has no config.json; point model.path at an HF checkpoint directory "
            f"(tiny models are built by molt.tiny.build_tiny)"
        )
    dtype = getattr(torch, plan.model.dtype)
    strategy = FSDP2Config(
        # Parameters and compute in the plan's dtype; gradients reduced in float32.
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        # Parameters, gradients and the optimizer step in host memory; on CPU they are there already.
        offload_policy=CPUOffloadPolicy() if plan.trainer.optimizer_offload and p.device == "cuda" else None,
    )
    sizes = ParallelismSizes(dp_size=plan.data_parallel_size, tp_size=p.tp_size, ep_size=p.ep_size)
    checkpointing = plan.trainer.gradient_checkpointing
    options = dict(dtype=dtype, attn_implementation=ATTENTION[p.attention])
    if value_head:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # else HF's token-classification head drops out 10 % of the values
        options["config"] = config

    if p.device == "cuda":
        from nemo_automodel import (
            NeMoAutoModelForCausalLM,
            NeMoAutoModelForImageTextToText,
            NeMoAutoModelForTokenClassification,
        )
        from nemo_automodel.components.distributed.config import DistributedSetup

        setup = DistributedSetup.build(strategy, sizes, activation_checkpointing=checkpointing)
        auto_class = NeMoAutoModelForTokenClassification if value_head else NeMoAutoModelForCausalLM
        if plan.model.multimodal:
            auto_class = NeMoAutoModelForImageTextToText
        if needs_hf_routers(plan):
            options["force_hf"] = True  # AutoModel's native MoE Gate has no hooks for molt/routing.py
        return auto_class.from_pretrained(path, distributed_setup=setup, **options), setup.mesh_context

    # NeMoAutoModelForCausalLM.from_pretrained hard-codes CUDA; AutoModel's mesh and parallelizer run on gloo.
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

    mesh = MeshContext.build(strategy, sizes, activation_checkpointing=checkpointing)
    if p.ep_size != 1:
        # Expert parallel shards AutoModel's native MoE classes (grouped experts), not the HF ones.
        if value_head:
            raise ValueError(
                f"critic.enabled=true with parallel.ep_size={p.ep_size} on parallel.device=cpu: AutoModel has "
                f"no native value-head MoE class; use parallel.ep_size=1 or parallel.device=cuda"
            )
        return parallelize_model(_native_qwen3_moe(path, dtype), mesh), mesh
    auto_class = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    if plan.model.multimodal:
        auto_class = AutoModelForImageTextToText
    return parallelize_model(auto_class.from_pretrained(path, **options), mesh), mesh


# AutoModel's native Qwen3-MoE groups each layer's experts as [experts, in, out] (x @ w); transformers 5 fuses
# them as [experts, out, in] (F.linear). All other parameter names and layouts agree.
NATIVE_EXPERTS = {
    "mlp.experts.gate_and_up_projs": "mlp.experts.gate_up_proj",
    "mlp.experts.down_projs": "mlp.experts.down_proj",
}


def _rename_expert(name: str, tensor: Tensor, names: dict[str, str]) -> tuple[str, Tensor]:
    """Rename an expert tensor by `names` (suffix -> suffix) and swap its last two dimensions."""
    for old, new in names.items():
        if name.endswith(old):
            return name[: -len(old)] + new, tensor.transpose(1, 2).contiguous()
    return name, tensor


def _rename_experts(state: dict[str, Tensor], names: dict[str, str]) -> dict[str, Tensor]:
    return dict(_rename_expert(name, tensor, names) for name, tensor in state.items())


def _is_native(model) -> bool:
    """Whether `model` is one of AutoModel's native classes rather than a transformers model."""
    from transformers import PreTrainedModel

    return not isinstance(model, PreTrainedModel)


def hf_layout(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A native Qwen3-MoE state dict named and laid out as the HF model's state_dict()."""
    return _rename_experts(state, NATIVE_EXPERTS)


def native_layout(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The HF Qwen3-MoE state dict named and laid out as AutoModel's native class's."""
    return _rename_experts(state, {hf: native for native, hf in NATIVE_EXPERTS.items()})


def _native_qwen3_moe(path: str, dtype: torch.dtype):
    """AutoModel's native Qwen3-MoE on the CPU with the weights of the HF checkpoint at `path`."""
    from unittest import mock

    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if config.model_type != "qwen3_moe":
        raise ValueError(
            f"parallel.ep_size > 1 on parallel.device=cpu supports Qwen3-MoE checkpoints only; {path} is "
            f"{config.model_type}: use parallel.ep_size=1 or parallel.device=cuda"
        )
    # Qwen3MoeModel.__init__ (nemo_automodel/components/models/qwen3_moe/model.py) builds its RotaryEmbedding
    # with device=torch.device(f"cuda:{torch.cuda.current_device()}"), which raises on a CPU-only torch. Answer
    # 0 while it is built, then point the embedding at the CPU before its first use, as AutoModel's own
    # initialize_weights does (`self.model.rotary_emb.device = buffer_device`).
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        # No hidden load-balancing gradient (AutoModel adds config.router_aux_loss_coef x its aux loss in the
        # router's backward; the HF model does not): the MoE auxiliary loss is molt's loss.moe_aux_coef.
        model = Qwen3MoeForCausalLM(config, moe_overrides={"aux_loss_coeff": 0.0})
    model.model.rotary_emb.device = torch.device("cpu")
    hf_state = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()
    model.load_state_dict(native_layout(hf_state), strict=True)
    return model.to(dtype)


def needs_hf_routers(plan: Plan) -> bool:
    """Whether the plan uses routing replay, a frozen router or the MoE auxiliary loss (molt/routing.py)."""
    return plan.model.routing_replay or plan.model.freeze_router or plan.loss.moe_aux_coef != 0


def lr_factor(step: int, cfg: TrainerPlan, total_steps: int) -> float:
    """Learning-rate multiplier before optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress  # linear


class PolicyWorker:
    """One trainer rank, run as a Ray actor. With trainable=False it only computes log-probabilities
    (a reference model or distillation teacher) and has no optimizer."""

    value_head = False  # True in CriticWorker

    def __init__(self, plan: Plan, rank: int, world_size: int, model_path: str, trainable: bool):
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self.model_path, self.trainable = model_path, trainable
        self.device = torch.device("cuda", 0) if plan.parallel.device == "cuda" else torch.device("cpu")

    def master_address(self) -> tuple[str, int]:
        """An address and free port on this node for the process-group rendezvous (asked of rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group and load the model; returns the rank's torch thread count."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Ray shows each actor only its own GPU
        else:
            torch.set_num_threads(rank_threads(self.plan))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        torch.manual_seed(self.plan.seed)

        from nemo_automodel.components.distributed.mesh_utils import get_flat_mesh

        self.model, self.mesh = load_model(self.plan, self.model_path, self.value_head)
        dp_mesh = get_flat_mesh(self.mesh.device_mesh, "dp")
        self.dp_rank, self.dp_size, self.dp_group = dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group()
        self.routers = self._hook_routers()
        if not self.trainable:
            self.model.eval()
            return torch.get_num_threads()
        cfg = self.plan.trainer
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.plan.critic.lr if self.value_head else cfg.lr,
            betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
        )
        total_steps = cfg.steps * cfg.epochs_per_batch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, cfg, total_steps)
        )
        return torch.get_num_threads()

    def _hook_routers(self) -> Optional[routing.RouterHooks]:
        """Hooks on the MoE routers (None for a dense model or a critic); freezes them for model.freeze_router.
        Called after sharding: FSDP2 creates the unsharded parameters with the sharded ones' requires_grad at
        the first forward, and the optimizer takes only parameters that require gradients."""
        if self.value_head:
            return None
        routers = routing.moe_routers(self.model)
        if not routers:
            if needs_hf_routers(self.plan):
                raise ValueError(
                    f"model.routing_replay / model.freeze_router / loss.moe_aux_coef need an MoE model with "
                    f"transformers' Qwen3-MoE or Qwen3.5-MoE routers; {type(self.model).__name__} at "
                    f"{self.model_path} has none: turn them off"
                )
            return None
        hooks = routing.RouterHooks(routers)
        if self.plan.model.freeze_router:
            for parameter in hooks.parameters():
                parameter.requires_grad_(False)
        return hooks

    def _shard(self, data: dict) -> dict:
        """This data-parallel rank's rows (the driver padded the batch to a multiple of dp_size)."""
        return {k: v if v is None else v.tensor_split(self.dp_size)[self.dp_rank] for k, v in data.items()}

    def _micro_batches(self, shard: dict) -> list[dict]:
        rows = len(shard["token_ids"])
        chunks = math.ceil(rows / self.plan.trainer.micro_batch_size)
        parts = {k: v if v is None else v.tensor_split(chunks) for k, v in shard.items()}
        return [{k: None if v is None else v[i] for k, v in parts.items()} for i in range(chunks)]

    def _forward(self, mb: dict, temperature: float) -> tuple[Tensor, Tensor]:
        """Log-probabilities [b, T] of the micro-batch's own tokens (0 at position 0) and the
        temperature-scaled logits [b, L-1, V] that predict tokens 1..L-1, where L is the longest sequence in
        the micro-batch. Both on the model's device. With model.routing_replay the MoE layers use
        mb["routed_experts"] [b, T, layers, top_k] (molt/routing.py); a multimodal model gets the image
        tensors (IMAGE_INPUTS) of the micro-batch's sequences."""
        token_ids, routed_experts = mb["token_ids"], mb.get("routed_experts")
        length = int(mb["attention_mask"].sum(1).max())
        ids = token_ids[:, :length].to(self.device)
        if self.routers is not None:
            replay = routed_experts is not None and self.plan.model.routing_replay
            self.routers.begin(routed_experts[:, :length] if replay else None)
        images = {}
        # A micro-batch of text-only sequences has only padding images, which the HF forward cannot take.
        if mb.get("pixel_attention_mask") is not None and mb["pixel_attention_mask"].any():
            images = {name: mb[name].to(self.device) for name in IMAGE_INPUTS}
        # Right padding: under causal attention real tokens never see the pads, so no attention mask is needed.
        logits = self.model(input_ids=ids, use_cache=False, **images).logits[:, :-1].float() / temperature
        logprobs = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return F.pad(logprobs, (1, token_ids.shape[1] - length)), logits

    @torch.no_grad()
    def logprobs(self, data: dict, temperature: float) -> tuple[int, Tensor]:
        self.model.eval()
        shard = self._shard(data)
        parts = [self._forward(mb, temperature)[0].cpu() for mb in self._micro_batches(shard)]
        return self.dp_rank, torch.where(shard["action_mask"], torch.cat(parts), 0.0)

    def train_step(self, data: dict, kl_coef: float) -> tuple[int, Optional[Tensor], dict]:
        """Returns (dp rank, the old log-probs of this rank's rows if it computed them, metrics). Without
        data["old_logprobs"] (one epoch only) they are this forward's own, detached: the weights do not
        change before the optimizer step at the end."""
        started = time.perf_counter()
        plan = self.plan
        shard = self._shard(data)
        own_old_logprobs = []
        temperature = plan.rollout.temperature  # the new policy is scored like the old one: as sampled
        use_kl = data["ref_logprobs"] is not None
        kl_in_loss = use_kl and not plan.loss.kl_in_reward and kl_coef != 0
        self.model.train()
        sums: dict[str, float] = {}  # token-weighted metric sums: this rank's share of the global token mean
        maxima: dict[str, float] = {}
        forward_s = backward_s = 0.0
        grad_norms, lrs = [], []

        def add(name: str, value: float) -> None:
            sums[name] = sums.get(name, 0.0) + value

        for _ in range(plan.trainer.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            for mb in self._micro_batches(shard):
                start = time.perf_counter()
                mb = {k: v if v is None else v.to(self.device) for k, v in mb.items()}
                mask, weights = mb["loss_mask"], mb["loss_weights"]
                share = float(weights.sum())  # this micro-batch's share of the step's loss
                logprobs, logits = self._forward(mb, temperature)
                old_logprobs = mb["old_logprobs"]
                if old_logprobs is None:
                    old_logprobs = logprobs.detach()
                    own_old_logprobs.append(old_logprobs.cpu())
                is_weights, _ = losses.importance_weights(
                    old_logprobs, mb["rollout_logprobs"], mask, plan.loss.importance_sampling
                )
                per_token, metrics = losses.policy_loss(
                    logprobs, old_logprobs, mb["advantages"], mask, plan.loss, is_weights
                )
                policy = losses.aggregate(per_token, weights)
                loss = policy
                with torch.set_grad_enabled(plan.loss.entropy_coef != 0):
                    # Entropy of the distribution each action token was drawn from, aligned like the logprobs.
                    token_entropy = losses.entropy(logits)
                    token_entropy = F.pad(token_entropy, (1, mask.shape[1] - token_entropy.shape[1] - 1))
                    entropy = losses.aggregate(token_entropy, weights)
                loss = loss - plan.loss.entropy_coef * entropy
                if use_kl:
                    kl_tokens = losses.kl_penalty(logprobs, mb["ref_logprobs"], plan.loss.kl_estimator)
                    kl = losses.aggregate(kl_tokens, weights)
                    if kl_in_loss:
                        loss = loss + kl_coef * kl
                    add("loss/kl", kl.item())
                if self.routers is not None:
                    loss = loss + self._moe_terms(mb, share, add)
                forward_s += time.perf_counter() - start

                start = time.perf_counter()
                # FSDP2 averages gradients over the data-parallel ranks; scaling by their number makes it a sum.
                (loss * self.dp_size).backward()
                backward_s += time.perf_counter() - start

                for name, value in metrics.items():
                    if name.endswith("_max"):
                        maxima[name] = max(maxima.get(name, value), value)
                    else:
                        add(name, value * share)
                add("loss/total", loss.item())
                add("loss/policy", policy.item())
                add("entropy", entropy.item())
            lrs.append(self.optimizer.param_groups[0]["lr"])
            grad_norms.append(float(self._clip_and_step()))

        epochs = plan.trainer.epochs_per_batch
        sums = all_reduce_metrics(sums, dist.ReduceOp.SUM, self.dp_group)
        result = {name: value / epochs for name, value in sums.items()}
        result.update(all_reduce_metrics(maxima, dist.ReduceOp.MAX, self.dp_group))
        if "moe/routes_compared" in result:
            compared = result.pop("moe/routes_compared")
            result["moe/routing_agreement"] = result.pop("moe/routes_matching") / max(compared, 1)
        old_logprobs = None
        if own_old_logprobs:
            old_logprobs = torch.where(shard["action_mask"], torch.cat(own_old_logprobs), 0.0)
        return self.dp_rank, old_logprobs, result | {
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": lrs[-1],
            "optimizer_steps": self.scheduler.last_epoch,
            "time/forward_s": forward_s,
            "time/backward_s": backward_s,
            "time/rank_s": time.perf_counter() - started,  # the rest is the optimizer and collectives
        }

    def _moe_terms(self, mb: dict, share: float, add) -> Tensor:
        """The weighted MoE auxiliary loss of the forward just run (its share of the global token mean, as for
        the other loss terms); logs it and, given engine routes, counts the (token, layer)s on which the
        actor's own routers agree with the engine."""
        length = int(mb["attention_mask"].sum(1).max())
        with torch.set_grad_enabled(self.plan.loss.moe_aux_coef != 0):
            aux = routing.load_balancing_loss(self.routers.calls, mb["attention_mask"][:, :length]) * share
        add("loss/moe_aux", aux.item())
        if mb["routed_experts"] is not None:
            live = self.routers.live_routes().view(len(mb["token_ids"]), length, *mb["routed_experts"].shape[2:])
            matching, compared = routing.routing_agreement(live, mb["routed_experts"][:, :length])
            add("moe/routes_matching", matching)
            add("moe/routes_compared", compared)
        return self.plan.loss.moe_aux_coef * aux

    def _clip_and_step(self) -> Tensor:
        from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm

        ep = self.mesh.moe_mesh is not None and self.mesh.ep_size > 1
        # AutoModel's clipping reduces the norm over the dp and expert-parallel meshes; plain
        # clip_grad_norm_ cannot handle the two meshes of expert parallel.
        grad_norm = scale_grads_and_clip_grad_norm(
            self.plan.trainer.grad_clip or float("inf"),  # 0 = no clipping, but still report the norm
            [self.model],
            device_mesh=self.mesh.device_mesh,
            moe_mesh=self.mesh.moe_mesh,
            ep_axis_name="ep" if ep else None,
            dp_group_size=self.dp_size,
        )
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def state_dict(self) -> Optional[dict[str, Tensor]]:
        """The full HF-format state dict on CPU, returned by rank 0 (every rank must take part)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if self.rank != 0:
            return None
        return hf_layout(state) if _is_native(self.model) else state

    def _engine_tensors(self, gather: bool = True) -> Iterator[tuple[str, Tensor]]:
        """The policy's tensors as the engines load them (HF names and layouts; a tied parameter once), one at
        a time. gather: each is all-gathered from its shards just before it is yielded (a collective: every
        rank iterates, in the same order), so no rank ever holds a second copy of the model; otherwise meta
        tensors of the full shapes. vLLM loads transformers-5's fused MoE experts as they are."""
        # Later names of a parameter (a tied lm_head) are skipped; the same on every rank, as the modules are.
        first, tied = set(), set()
        for name, parameter in self.model.named_parameters(remove_duplicate=False):
            if id(parameter) in first:
                tied.add(name)
            first.add(id(parameter))
        native = _is_native(self.model)
        for name, tensor in get_model_state_dict(self.model).items():  # sharded: no copy
            if name in tied:
                continue
            if gather:
                if isinstance(tensor, DTensor):  # offloaded shards sit in host memory: gather on the rank's device
                    tensor = tensor.to(self.device).full_tensor()
            else:
                tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            yield _rename_expert(name, tensor, NATIVE_EXPERTS) if native else (name, tensor)

    def refit_offer(self):
        """Rank 0: the RefitGroup it offers the engines (a port to join it on, the names, dtypes and shapes
        every refit sends)."""
        from molt.refit_worker import RefitGroup

        ro = self.plan.rollout
        return RefitGroup.offer(self._engine_tensors(gather=False), self.device, backend=ro.weight_transfer,
                                timeout_s=ro.refit_timeout_s)

    def join_refit(self, group) -> None:
        """Rank 0: join the refit group as its sender (with the engines, see Generator.connect_refit)."""
        from molt.refit_worker import join

        self.refit_group, self.refit_pg = group, join(group, rank=0, device=self.device)

    def send_weights(self) -> None:
        """Every rank's part of a refit: gather the tensors one by one; rank 0 broadcasts them to the engines."""
        tensors = self._engine_tensors()
        if self.rank != 0:
            for _ in tensors:  # this rank's share of each all-gather
                pass
            return
        from molt.refit_worker import send

        send(self.refit_pg, self.refit_group, tensors, self.device)

    def save(self, path: str) -> None:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        local = {"rng": rng, "scheduler": self.scheduler.state_dict()}
        torch.save(local, os.path.join(path, f"rank{self.rank}.pt"))

    def load(self, path: str) -> int:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        local = torch.load(os.path.join(path, f"rank{self.rank}.pt"), weights_only=False)
        self.scheduler.load_state_dict(local["scheduler"])
        torch.set_rng_state(local["rng"]["cpu"])
        if "cuda" in local["rng"]:
            torch.cuda.set_rng_state(local["rng"]["cuda"])
        return self.scheduler.last_epoch

    def export_hf(self, path: str) -> None:
        state = self.state_dict()
        if self.rank == 0:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

            model = self.model
            if _is_native(model):
                # AutoModel's native class saves only through its Checkpointer: save through the HF class,
                # built without weights (the state dict carries them).
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path))
            model.save_pretrained(path, state_dict=state)
            if self.plan.model.multimodal:
                from transformers import AutoProcessor

                AutoProcessor.from_pretrained(self.model_path).save_pretrained(path)  # its tokenizer too
            else:
                AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def all_reduce_metrics(values: dict[str, float], op, group) -> dict[str, float]:
    """Reduce a dict of scalars over the data-parallel ranks in one collective."""
    names = sorted(values)
    reduced = torch.tensor([values[n] for n in names], dtype=torch.float64)
    dist.all_reduce(reduced, op=op, group=group)
    return dict(zip(names, reduced.tolist()))


class Trainer:
    """Driver-side handle on a group of `PolicyWorker` ranks (plan.parallel.actor_ranks of them).

    trainable=False makes a reference model / teacher: it loads plan.reference.path (or the policy's initial
    weights) and offers only `logprobs`.
    """

    worker_class = PolicyWorker

    def __init__(self, plan: Plan, trainable: bool = True, placement: Optional[list] = None):
        if plan.trainer.micro_batch_size < 1 or plan.trainer.epochs_per_batch < 1:
            raise ValueError("trainer.micro_batch_size and trainer.epochs_per_batch must be at least 1")
        if plan.trainer.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"trainer.lr_schedule='{plan.trainer.lr_schedule}' is not one of {', '.join(LR_SCHEDULES)}"
            )
        self.plan, self.trainable = plan, trainable
        path = plan.model.path if trainable else (plan.reference.path or plan.model.path)
        ranks = plan.parallel.actor_ranks
        # placement: one Ray scheduling strategy per rank (molt.placement.reserve); None lets Ray choose.
        worker = ray.remote(self.worker_class)
        self.workers = [
            worker.options(**rank_resources(plan), scheduling_strategy=strategy).remote(plan, rank, ranks, path, trainable)
            for rank, strategy in enumerate(placement or [None] * ranks)
        ]
        try:
            address, port = ray.get(self.workers[0].master_address.remote())
            self.threads = ray.get([w.setup.remote(address, port) for w in self.workers])  # per rank
        except Exception:
            self.shutdown(graceful=False)  # a failed start must not leave ranks holding CPUs or GPUs
            raise
        self.step = 0  # optimizer steps taken

    def _put(self, batch: TrainBatch, **tensors: Optional[Tensor]) -> ray.ObjectRef:
        """Store the batch's [B, T] tensors once for all ranks, padded to a multiple of the data-parallel size
        with copies of row 0 that carry no loss (every rank must run the same number of forward passes)."""
        data = dict(token_ids=batch.token_ids, attention_mask=batch.attention_mask,
                    action_mask=batch.action_mask, **tensors)
        data.update({name: getattr(batch, name) for name in IMAGE_INPUTS if getattr(batch, name) is not None})
        pad = -len(batch) % self.plan.data_parallel_size
        if pad:
            rows = torch.cat([torch.arange(len(batch)), torch.zeros(pad, dtype=torch.long)])
            data = {k: None if v is None else v[rows] for k, v in data.items()}
            for mask in ("action_mask", "loss_mask"):
                if data.get(mask) is not None:
                    data[mask][-pad:] = False
            if data.get("loss_weights") is not None:
                data["loss_weights"][-pad:] = 0.0
            if data.get("routed_experts") is not None:
                data["routed_experts"][-pad:] = -1  # the copies do not count in the routing agreement
        return ray.put(data)

    def logprobs(self, batch: TrainBatch, temperature: float, routed_experts: Optional[Tensor] = None) -> Tensor:
        """log p(token_t | tokens_<t) [B, T] of the batch's exact tokens, with the logits divided by the
        sampling temperature as the engine does; 0 off the action mask. With model.routing_replay the MoE
        layers replay `routed_experts` [B, T, layers, top_k] (-1: no recorded route; molt/routing.py)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        _check_routes(batch, routed_experts)
        data = self._put(batch, routed_experts=routed_experts)
        return gather_rows(ray.get([w.logprobs.remote(data, temperature) for w in self.workers]), len(batch))

    def train_step(self, batch: TrainBatch, advantages: Tensor, old_logprobs: Optional[Tensor], loss_mask: Tensor,
                   ref_logprobs: Optional[Tensor] = None, routed_experts: Optional[Tensor] = None,
                   kl_coef: Optional[float] = None) -> tuple[dict[str, float], Tensor]:
        """plan.trainer.epochs_per_batch passes over the batch, one optimizer step per pass, each token's
        loss weighted by its importance weight (loss.importance_sampling) of old_logprobs against the
        engine's batch.rollout_logprobs. old_logprobs None (one epoch only) takes the old log-probs from the
        training forward itself, which runs on the same weights as a separate `logprobs` pass would.
        Every per-token loss term becomes the step's loss through the weights of losses.token_weights
        (loss.aggregation), computed here over the whole batch.

        Returns the metrics and the old log-probs used [B, T]. Metrics: the loss terms (aggregated with
        loss_weights), grad_norm, lr, entropy, clip fraction, tokens and timings; for MoE models loss/moe_aux and,
        given the engine's `routed_experts` [B, T, layers, top_k] (replayed with model.routing_replay),
        moe/routing_agreement. kl_coef (default loss.kl_coef) weighs the KL loss term against ref_logprobs;
        the loop passes the adaptive controller's current value."""
        self._require_trainable("train")
        if old_logprobs is None and self.plan.trainer.epochs_per_batch != 1:
            raise ValueError(
                f"train_step needs old_logprobs with trainer.epochs_per_batch="
                f"{self.plan.trainer.epochs_per_batch}: later epochs must not score the old policy with "
                f"updated weights"
            )
        check_shapes(batch, advantages=advantages, old_logprobs=old_logprobs, loss_mask=loss_mask,
                     ref_logprobs=ref_logprobs)
        _check_routes(batch, routed_experts)
        start = time.perf_counter()
        num_tokens = int(loss_mask.sum())
        agent = self.plan.agent
        loss_weights = losses.token_weights(loss_mask, batch.rollout_ids, self.plan.loss.aggregation,
                                            max_rollout_tokens=agent.max_turns * agent.max_tokens_per_turn)
        data = self._put(batch, advantages=advantages.float(), rollout_logprobs=batch.rollout_logprobs.float(),
                         old_logprobs=None if old_logprobs is None else old_logprobs.float(),
                         loss_mask=loss_mask.bool(), loss_weights=loss_weights, ref_logprobs=ref_logprobs,
                         routed_experts=routed_experts)
        kl_coef = self.plan.loss.kl_coef if kl_coef is None else kl_coef
        results = ray.get([w.train_step.remote(data, kl_coef) for w in self.workers])
        metrics = results[0][2]
        self.step = metrics.pop("optimizer_steps")
        if old_logprobs is None:
            old_logprobs = gather_rows([(dp_rank, own) for dp_rank, own, _ in results], len(batch))
        return metrics | {"tokens": num_tokens, "time/train_s": time.perf_counter() - start}, old_logprobs

    def _require_trainable(self, action: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"this Trainer is a reference model (trainable=False); it cannot {action}")

    def state_dict(self) -> dict[str, Tensor]:
        """The policy's full (unsharded) state dict on CPU, named as the HF model's state_dict(). For
        transformers-5 MoE models that is the fused expert layout (mlp.experts.gate_up_proj), not the per-expert
        tensors on disk; transformers.core_model_loading.revert_weight_conversion maps it back."""
        return ray.get([w.state_dict.remote() for w in self.workers])[0]

    def refit_offer(self):
        """The RefitGroup rank 0 offers the engines (Generator.connect_refit)."""
        return ray.get(self.workers[0].refit_offer.remote())

    def join_refit(self, group) -> None:
        """Rank 0 joins the refit group; call together with the engines (Generator.connect_refit)."""
        ray.get(self.workers[0].join_refit.remote(group))

    def send_weights(self) -> None:
        """Broadcast the policy's weights to the refit group; call together with the engines' receive
        (Generator.update_weights)."""
        self._require_trainable("send weights")
        ray.get([w.send_weights.remote() for w in self.workers])

    def save(self, root: str, extra: dict) -> str:
        """Write a distributed checkpoint of model, optimizer, scheduler and RNG plus the JSON `extra` to
        root/step_<n>, atomically, and delete all but the newest plan.checkpoint.keep. Returns its path.
        With ranks on several nodes, root must be on a file system they and the driver share."""
        self._require_trainable("save a checkpoint")
        json.dumps(extra)  # fail before writing anything if `extra` is not JSON-able
        final = os.path.join(os.path.abspath(root), f"{CHECKPOINT_PREFIX}{self.step:08d}")
        tmp = os.path.join(os.path.dirname(final), f".tmp-{os.path.basename(final)}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        ray.get([w.save.remote(tmp) for w in self.workers])
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            json.dump(extra, f)
        shutil.rmtree(final, ignore_errors=True)  # a second save at the same step replaces the first
        os.rename(tmp, final)
        keep = self.plan.checkpoint.keep
        if keep > 0:  # 0 keeps all
            for old in _complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old)
        return final

    def load(self, path: str) -> dict:
        """Restore a checkpoint written by `save` (model, optimizer, scheduler, RNG); returns its `extra`.
        `path` is one checkpoint (root/step_<n>, e.g. from latest_checkpoint), not the root."""
        self._require_trainable("load a checkpoint")
        if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})")
        self.step = ray.get([w.load.remote(os.path.abspath(path)) for w in self.workers])[0]
        with open(os.path.join(path, COMPLETE_MARKER)) as f:
            return json.load(f)

    def export_hf(self, path: str) -> None:
        """Save the current policy in HF save_pretrained format, with the tokenizer of model.path."""
        ray.get([w.export_hf.remote(os.path.abspath(path)) for w in self.workers])

    def shutdown(self, graceful: bool = True) -> None:
        if graceful:
            ray.get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def gather_rows(results: list[tuple[int, Tensor]], rows: int) -> Tensor:
    """Concatenate per-rank results in data-parallel order, dropping the padding rows."""
    by_dp_rank = dict(results)  # tensor-parallel ranks of one dp rank return the same rows
    return torch.cat([by_dp_rank[r] for r in sorted(by_dp_rank)])[:rows]


def check_shapes(batch: TrainBatch, **tensors: Optional[Tensor]) -> None:
    expected = tuple(batch.token_ids.shape)
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"train_step: {name} has shape {tuple(tensor.shape)}, the batch is {expected}")


def _check_routes(batch: TrainBatch, routed_experts: Optional[Tensor]) -> None:
    if routed_experts is None:
        return
    if routed_experts.dim() != 4 or routed_experts.shape[:2] != batch.token_ids.shape:
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)}; it must be [B, T, layers, top_k] with "
            f"[B, T] = {tuple(batch.token_ids.shape)}, the batch's"
        )
    if routed_experts.is_floating_point() or not routed_experts.is_signed():
        raise ValueError(f"routed_experts must be signed integers (-1: no route), got {routed_experts.dtype}")


def _complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under root, oldest first."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith(CHECKPOINT_PREFIX)]
    paths = [os.path.join(root, n) for n in sorted(names)]
    return [p for p in paths if os.path.isfile(os.path.join(p, COMPLETE_MARKER))]


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint under root, or None; unfinished writes are ignored."""
    checkpoints = _complete_checkpoints(root)
    return checkpoints[-1] if checkpoints else None
