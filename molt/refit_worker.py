"""Refit on CPU: a vLLM weight-transfer backend that runs inside vLLM's worker processes.

vLLM's own transfer backends (NCCL, CUDA IPC) need a GPU. This backend receives the new weights as
`torch.save` bytes inside the update request and loads them with vLLM's layerwise reload. vLLM imports
this module in each worker because the engine names `RefitWorkerExtension` as its
`worker_extension_cls`; importing it registers the backend under `CPU_BACKEND`.
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

CPU_BACKEND = "molt_cpu"


@dataclass
class CpuInitInfo(WeightTransferInitInfo):
    pass  # nothing to rendezvous: the weights travel inside the update request


@dataclass
class CpuUpdateInfo(WeightTransferUpdateInfo):
    # torch.save of {HF parameter name: tensor}. Bytes, because vLLM's RPC would turn tensors into lists.
    payload: bytes


class CpuWeightTransferEngine(WeightTransferEngine[CpuInitInfo, CpuUpdateInfo]):
    init_info_cls = CpuInitInfo
    update_info_cls = CpuUpdateInfo

    def init_transfer_engine(self, init_info: CpuInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with an accelerator synchronize, which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CpuUpdateInfo) -> None:
        named_tensors = torch.load(io.BytesIO(update_info.payload), weights_only=True)
        self.model.load_weights(named_tensors.items())

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
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


WeightTransferEngineFactory.register_engine(CPU_BACKEND, CpuWeightTransferEngine)
