"""Refit: the trainer's weights broadcast over one process group to every worker of every engine.

The group: rank 0 is the sender (trainer rank 0), then the vLLM workers of engine i from rank
1 + i x workers per engine. It is made with vLLM's stateless process-group helper, so it touches neither
side's default group, and it lives as long as the engines. What every refit sends is agreed once, when the
group forms (`RefitGroup`: names, dtypes and shapes in order, bucket size); a refit then moves only tensor
bytes: the tensors, in that order, as one byte stream cut into fixed-size buckets, each broadcast from
rank 0. The sender gathers one tensor at a time and a receiver yields each tensor as soon as its last byte
arrived, so neither side holds more than one bucket and one tensor in flight. Each side allocates its bucket
once, when it joins, and reuses it: on CPU a fresh 64 MiB buffer per refit cost a page fault per 4 KiB
touched, more than the copy into it.

A receiver may start a refit before the sender does: it first waits for the sender's doorbell, a key the
sender sets in the group's store when it starts, and that wait is not bounded by `timeout_s` (SENDER_WAIT:
in a sync schedule the engines wait there while the actor trains, so the weights go out the moment its
optimizer step is done). The store is served from the sender's process, so a dead sender fails the wait at
once; a sender that cannot send (its train step failed) rings `abort` instead.

Backend: NCCL (buckets on the GPUs) when no engine worker shares trainer rank 0's GPU; gloo through host
memory on CPU, or when one does (NCCL refuses two ranks of one communicator on one GPU). Each collective
waits at most `timeout_s`: a dead or silent peer is an error, never a hang (the doorbell waits for a live
sender only).

The receiving side is a vLLM weight-transfer backend: vLLM imports this module in each worker because the
engine names `RefitWorkerExtension` as its `worker_extension_cls`, and the import registers it under
`BACKEND`. vLLM's model-side modules are imported inside the methods, so that the trainer's import stays light.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "molt_broadcast"
BUCKET_BYTES = 64 << 20  # large enough that a bucket's broadcast is bandwidth-bound, small next to a model
# How long a receiver waits for the sender to start a refit: the sender may be training. A dead sender fails
# the wait at once, and the loop stops the engines when the trainer fails.
SENDER_WAIT = timedelta(days=1)


@dataclass
class RefitGroup(WeightTransferInitInfo):
    """What both ends of a refit agree on once, when the group forms: where rank 0 waits, the backend, and
    what every refit sends. It is also the init info that vLLM hands each worker's engine below."""

    host: str
    port: int
    names: list[str]
    dtypes: list[str]  # torch dtype names ("bfloat16")
    shapes: list[list[int]]
    bucket_bytes: int = BUCKET_BYTES
    timeout_s: float = 300.0
    backend: str = "auto"  # rollout.weight_transfer until Generator.connect_refit resolves it to gloo or nccl
    sender_gpu: Optional[str] = None  # UUID of the sender's GPU; None on CPU
    world_size: int = 0  # set by Generator.connect_refit: 1 + every engine worker
    rank_offset: int = 0  # set per engine: the rank of its first worker

    @classmethod
    def offer(cls, named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device = torch.device("cpu"),
              **options) -> "RefitGroup":
        """Rank 0's side of the agreement: the tensors it will send from `device`, in order (meta tensors
        will do), and a free port on this host for the rendezvous."""
        import ray

        names, dtypes, shapes = [], [], []
        for name, tensor in named_tensors:
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        gpu = _gpu_uuid(device) if device.type == "cuda" else None
        return cls(host=host, port=port, names=names, dtypes=dtypes, shapes=shapes, sender_gpu=gpu, **options)

    def sizes(self) -> list[int]:
        """Bytes of each tensor."""
        return [math.prod(shape) * getattr(torch, dtype).itemsize for dtype, shape in zip(self.dtypes, self.shapes)]

    def buckets(self) -> list[int]:
        """Bytes of each bucket: the stream of all tensors cut every bucket_bytes."""
        full, rest = divmod(sum(self.sizes()), self.bucket_bytes)
        return [self.bucket_bytes] * full + [rest] * (rest > 0)

    def wire_device(self, device: torch.device) -> torch.device:
        """Where this process's buckets live: on its GPU under NCCL, else in host memory."""
        return device if self.backend == "nccl" else torch.device("cpu")

    def wire_bucket(self, device: torch.device = torch.device("cpu")) -> torch.Tensor:
        """The buffer one rank sends or receives every refit through: one bucket, or the whole stream when
        that is smaller; join() allocates it once per group (RefitPeer.bucket)."""
        return torch.empty(min(self.bucket_bytes, sum(self.sizes())), dtype=torch.uint8,
                           device=self.wire_device(device))


def refit_backend(weight_transfer: str, sender_gpu: Optional[str], engine_gpus: list[Optional[str]]) -> str:
    """gloo or nccl for a refit group, from rollout.weight_transfer (auto | gloo) and where its ranks run."""
    if weight_transfer == "gloo" or sender_gpu is None:
        return "gloo"
    if sender_gpu in engine_gpus:  # NCCL: "Duplicate GPU detected"
        return "gloo"
    return "nccl"


@dataclass
class RefitPeer:
    """One rank's membership of the refit group, from join(): what it sends or receives through."""

    group: RefitGroup
    pg: dist.ProcessGroup
    store: dist.Store  # the rendezvous store, served from rank 0's process: the sender's doorbell
    bucket: torch.Tensor  # group.wire_bucket, allocated once
    refits: int = 0  # refits this rank has started

    @property
    def doorbell(self) -> str:
        """The store key of the current refit's doorbell."""
        return f"molt/refit/{self.refits}"

    def ring(self, message: str) -> None:
        self.refits += 1  # a doorbell stays set (a few bytes a refit): a slow receiver may not have looked yet
        self.store.set(self.doorbell, message)


def join(group: RefitGroup, rank: int, device: torch.device = torch.device("cpu")) -> RefitPeer:
    """Join the refit group as `rank` (blocks until every rank has joined, or timeout_s), then check that a
    broadcast really arrives: a transport that silently does nothing must fail here, loudly."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    try:
        pg, store = stateless_init_torch_distributed_process_group(
            group.host, group.port, rank, group.world_size, group.backend, timeout=timedelta(seconds=group.timeout_s),
            return_store=True,
        )
    except Exception as e:
        raise RuntimeError(
            f"refit group: rank {rank} of {group.world_size} could not join at {group.host}:{group.port} "
            f"within rollout.refit_timeout_s={group.timeout_s}: a peer died or never started ({e})"
        ) from e
    peer = RefitPeer(group, pg, store, group.wire_bucket(device))
    expected = torch.tensor([group.world_size, len(group.names)], device=group.wire_device(device))
    probe = expected.clone() if rank == 0 else torch.zeros_like(expected)
    _broadcast(probe, peer)
    if not torch.equal(probe, expected):
        raise RuntimeError(
            f"refit group: the {group.backend} broadcast delivered {probe.tolist()} instead of {expected.tolist()}"
            "; the transport does not work here (set rollout.weight_transfer=gloo to go through host memory)"
        )
    return peer


def send(peer: RefitPeer, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Rank 0's half of a refit: ring the receivers' doorbell, then broadcast `named_tensors`, which must match
    the group's names, dtypes and shapes in order (any layout: non-contiguous tensors are copied)."""
    peer.ring("send")
    group, bucket = peer.group, peer.bucket
    expected = list(zip(group.names, group.dtypes, group.shapes))
    filled = count = 0
    for name, tensor in named_tensors:
        got = (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        if count >= len(expected) or got != expected[count]:
            want = expected[count] if count < len(expected) else "nothing more"
            raise ValueError(f"refit: tensor {count} is {got}, the refit group agreed on {want}; the model "
                             "changed since the group formed")
        count += 1
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        done = 0
        while done < len(data):
            n = min(len(data) - done, len(bucket) - filled)
            bucket[filled : filled + n].copy_(data[done : done + n])
            filled, done = filled + n, done + n
            if filled == len(bucket):
                _broadcast(bucket, peer)
                filled = 0
    if count != len(expected):
        raise ValueError(f"refit: sent {count} tensors, the refit group agreed on {len(expected)}")
    if filled:
        _broadcast(bucket[:filled], peer)


def abort(peer: RefitPeer) -> None:
    """Rank 0: tell receivers waiting for this refit that no weights will come."""
    peer.ring("abort")


def wait_for_sender(peer: RefitPeer) -> None:
    """A receiver's start of a refit: return once the sender has started it (see SENDER_WAIT)."""
    peer.refits += 1
    try:
        peer.store.wait([peer.doorbell], SENDER_WAIT)
    except RuntimeError as e:  # DistNetworkError: the store's server, in the sender's process, is gone
        raise RuntimeError(f"refit: the sender (trainer rank 0) died before it sent refit {peer.refits} "
                           f"({type(e).__name__}: {str(e).splitlines()[0]})") from e
    if peer.store.get(peer.doorbell) == b"abort":
        raise RuntimeError(f"refit {peer.refits}: the sender aborted it (the train step before it failed); "
                           "these weights are unchanged")


def receive(peer: RefitPeer, device: torch.device = torch.device("cpu")) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's half of a refit, after wait_for_sender: yield each tensor of the group, on `device`, once
    its last byte came."""
    group, bucket = peer.group, peer.bucket
    wire = bucket.device
    buckets = iter(group.buckets())
    used = size = 0  # bytes of the current bucket consumed / received
    for name, dtype, shape, nbytes in zip(group.names, group.dtypes, group.shapes, group.sizes()):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=wire)
        data = tensor.view(-1).view(torch.uint8)
        done = 0
        while done < nbytes:
            if used == size:
                size, used = next(buckets), 0
                _broadcast(bucket[:size], peer)
            n = min(nbytes - done, size - used)
            data[done : done + n].copy_(bucket[used : used + n])
            used, done = used + n, done + n
        yield name, tensor.to(device)


def _broadcast(tensor: torch.Tensor, peer: RefitPeer) -> None:
    try:
        # group_src, not src: src is a rank of the default group, which this stateless group is not part of
        dist.broadcast(tensor, group=peer.pg, group_src=0)
    except RuntimeError as e:
        raise RuntimeError(
            f"refit broadcast failed: a peer of the refit group died or did not answer within "
            f"rollout.refit_timeout_s={peer.group.timeout_s} ({type(e).__name__}: {e})"
        ) from e


def _gpu_uuid(device: Optional[torch.device] = None) -> str:
    return str(torch.cuda.get_device_properties(device or torch.cuda.current_device()).uuid)


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    pass  # a refit sends only tensors; what they are was agreed in RefitGroup


class BroadcastWeightTransferEngine(WeightTransferEngine[RefitGroup, RefitUpdateInfo]):
    """One engine worker's end of the refit group."""

    init_info_cls = RefitGroup
    update_info_cls = RefitUpdateInfo

    def init_transfer_engine(self, init_info: RefitGroup) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.peer = join(init_info, rank, self.device)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with an accelerator synchronize, which raises on a CPU-only host.
        from vllm.platforms import current_platform

        self.receive_weights(self.parse_update_info(update_info))
        if not current_platform.is_cpu():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        self.model.load_weights(receive(self.peer, self.device))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.platforms import current_platform

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
        self.peer = None  # the group closes its connections when it is freed


class RefitWorkerExtension:
    """vLLM's `worker_extension_cls`: naming it makes each worker import this module (and with it the
    backend registration below) before it builds the model; its method is mixed into the worker."""

    def gpu_uuid(self) -> Optional[str]:
        """This worker's GPU, to tell whether it shares one with the sender (None on CPU)."""
        return _gpu_uuid() if torch.cuda.is_available() else None

    def receive_refit(self) -> None:
        """This worker's whole part of a refit, in one call from the engine instead of one round trip each:
        the wait for the sender, then vLLM's start, update (the receive) and finish of a weight update. The
        start (vLLM's reload set-up) comes after the wait, so that it does not take a core from a training
        sender."""
        wait_for_sender(self.weight_transfer_engine.peer)
        self.start_weight_update()
        self.update_weights({})
        self.finish_weight_update()


WeightTransferEngineFactory.register_engine(BACKEND, BroadcastWeightTransferEngine)
