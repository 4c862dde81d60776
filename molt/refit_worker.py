"""Refit through host memory: a vLLM weight-transfer backend that runs inside vLLM's worker processes.

This backend receives the new weights as `torch.save` bytes inside the update request and loads them with
vLLM's layerwise reload, on CPU and GPU engines alike. vLLM's own NCCL backend would move GPU weights
without the host copy, but its trainer side is not written yet (the validator refuses
rollout.weight_transfer=nccl). vLLM imports this module in each worker because the engine names
`RefitWorkerExtension` as its `worker_extension_cls`; importing it registers the backend under `BACKEND`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.platforms import current_platform

BACKEND = "molt_host"


@dataclass
class HostInitInfo(WeightTransferInitInfo):
    pass  # nothing to rendezvous: the weights travel inside the update request


@dataclass
class HostUpdateInfo(WeightTransferUpdateInfo):
    # torch.save of {HF parameter name: tensor}. Bytes, because vLLM's RPC would turn tensors into lists.
    payload: bytes


class HostWeightTransferEngine(WeightTransferEngine[HostInitInfo, HostUpdateInfo]):
    init_info_cls = HostInitInfo
    update_info_cls = HostUpdateInfo

    def init_transfer_engine(self, init_info: HostInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with an accelerator synchronize, which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))
        if not current_platform.is_cpu():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: HostUpdateInfo) -> None:
        named_tensors = torch.load(io.BytesIO(update_info.payload), weights_only=True)
        self.model.load_weights(named_tensors.items())

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        if not current_platform.is_cpu():
            return
        # Two vLLM-CPU kernels keep state built from the temporary layer that the reload discarded;
        # without rebuilding them the model silently keeps computing with stale weights.
        for module in self.model.modules():
            if isinstance(module, VocabParallelEmbedding):  # embedding and (tied) lm_head: oneDNN handle
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            moe_kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if moe_kernel is not None:  # fused experts: repack the reloaded weights
                moe_kernel.fused_experts.process_weights_after_loading(module)

    def shutdown(self) -> None:
        pass


class RefitWorkerExtension:
    """Named as vLLM's `worker_extension_cls` only so that workers import this module (and with it
    the backend registration below) before they build the model; it adds no worker methods."""


WeightTransferEngineFactory.register_engine(BACKEND, HostWeightTransferEngine)
