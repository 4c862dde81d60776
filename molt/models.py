"""Model loading: an HF checkpoint sharded with FSDP2 (and tp / ep) through NeMo AutoModel, and the layout of
AutoModel's native Qwen3-MoE class against the HF one. Runs in the trainer ranks (molt/ranks.py)."""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from molt.plan import Plan

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

    p = plan.parallel  # the validator refused pipeline and context parallel, and a critic under CPU ep
    # check_inputs checked model.path on the driver; a rank on another node may not see the same files
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
    sizes = ParallelismSizes(dp_size=plan.actor_dp_size, tp_size=p.tp_size, ep_size=p.ep_size)
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


def rename_expert(name: str, tensor: Tensor, names: dict[str, str]) -> tuple[str, Tensor]:
    """Rename an expert tensor by `names` (suffix -> suffix) and swap its last two dimensions."""
    for old, new in names.items():
        if name.endswith(old):
            return name[: -len(old)] + new, tensor.transpose(1, 2).contiguous()
    return name, tensor


def _rename_experts(state: dict[str, Tensor], names: dict[str, str]) -> dict[str, Tensor]:
    return dict(rename_expert(name, tensor, names) for name, tensor in state.items())


def is_native(model) -> bool:
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
