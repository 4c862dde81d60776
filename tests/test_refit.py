"""The refit broadcast's wire format and faults, on real gloo groups between threads and processes of this
machine (no engine): every tensor arrives bit-identical whatever the bucket size, and a dead or silent peer
is an error within the group's timeout, never a hang. The broadcast into running engines, checked by
log-probabilities, is in test_generator.py (and, through the loop, test_loop.py, test_multimodal.py)."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from molt.refit import RefitGroup, abort, join, receive, refit_backend, send, wait_for_sender

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_ranks(group: RefitGroup, sender, receiver):
    """Run sender(group) as rank 0 and receiver(group) as rank 1 of a fresh gloo group, in two threads."""
    group = dataclasses.replace(group, world_size=2, backend="gloo")
    with ThreadPoolExecutor(2) as pool:
        sent, received = pool.submit(sender, group), pool.submit(receiver, group)
        return sent.result(timeout=60), received.result(timeout=60)


def model_like_tensors():
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(40, 8, generator=generator)
    return {
        "embed.weight": embed,
        "norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
        "proj.weight": torch.randn(24, 6, generator=generator).t(),  # non-contiguous
        "experts.gate_up_proj": torch.randn(2, 6, 8, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(0.5),
        "lm_head.weight": embed,  # tied
    }


@pytest.mark.parametrize("bucket_bytes", [7, 100, 1 << 20])  # smaller than every tensor, between, one bucket
def test_every_tensor_arrives_bit_identical_whatever_the_buckets(bucket_bytes):
    """Two refits through the same buckets: each delivers exactly its own tensors."""
    tensors = model_like_tensors()
    updated = {name: (t.float() * 2 + 1).to(t.dtype) for name, t in tensors.items()}
    group = RefitGroup.offer(tensors.items(), bucket_bytes=bucket_bytes, timeout_s=30)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert len(group.buckets()) == math.ceil(total / bucket_bytes) and sum(group.buckets()) == total
    assert group.wire_bucket().numel() == min(bucket_bytes, total)

    def sender(g):
        peer = join(g, 0)
        for refit in (tensors, updated):
            send(peer, refit.items())

    def receiver(g):
        peer = join(g, 1)
        refits = []
        for _ in range(2):
            wait_for_sender(peer)
            refits.append(list(receive(peer)))
        return refits

    _, refits = two_ranks(group, sender, receiver)
    for sent, received in zip((tensors, updated), refits):
        assert [name for name, _ in received] == list(sent)
        for name, tensor in received:
            assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name]), name


def test_a_tensor_the_group_did_not_agree_on_is_refused_and_the_receiver_times_out():
    """The sender refuses before sending anything; the receiver, left waiting, fails after timeout_s."""
    tensors = model_like_tensors()
    group = RefitGroup.offer(tensors.items(), timeout_s=2)
    changed = dict(tensors, **{"norm.weight": torch.zeros(9, dtype=torch.bfloat16)})

    def sender(g):
        peer = join(g, 0)
        with pytest.raises(ValueError, match="tensor 1 is .*norm.weight.*the model changed"):
            send(peer, changed.items())
        time.sleep(g.timeout_s + 3)  # alive but silent: the receiver must not wait for it past its timeout

    def receiver(g):
        peer = join(g, 1)
        wait_for_sender(peer)  # the sender rang before it refused
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="refit broadcast failed.*refit_timeout_s=2"):
            list(receive(peer))
        return time.monotonic() - start

    _, waited = two_ranks(group, sender, receiver)
    assert waited < 2 + 2


def test_a_receiver_waits_for_a_late_sender_past_the_timeout_and_an_abort_ends_the_wait():
    """A sync schedule's engines start receiving while the actor trains, for longer than the group's timeout:
    the wait for the sender's doorbell is not bounded by it. A sender that cannot send (its train step failed)
    aborts the refit: the waiting receiver fails naming that, and the next refit goes through."""
    tensors = model_like_tensors()
    group = RefitGroup.offer(tensors.items(), timeout_s=1)

    def sender(g):
        peer = join(g, 0)
        time.sleep(g.timeout_s + 2)  # training
        abort(peer)
        time.sleep(0.5)
        send(peer, tensors.items())

    def receiver(g):
        peer = join(g, 1)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="refit 1: the sender aborted it"):
            wait_for_sender(peer)
        waited = time.monotonic() - start
        wait_for_sender(peer)
        return waited, list(receive(peer))

    _, (waited, received) = two_ranks(group, sender, receiver)
    assert waited > group.timeout_s + 1
    assert [name for name, _ in received] == list(tensors)
    assert all(torch.equal(tensor, tensors[name]) for name, tensor in received)


def test_a_peer_that_never_joins_is_an_error_after_the_timeout():
    group = dataclasses.replace(RefitGroup.offer([], timeout_s=2), world_size=2, backend="gloo")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 of 2 could not join.*refit_timeout_s=2"):
        join(group, 0)
    assert time.monotonic() - start < 2 + 3


PEER = """
import json, sys, time
from molt.refit import RefitGroup, join
peer = join(RefitGroup(**json.loads(sys.argv[1])), 0)
if sys.argv[2] == "rang":
    peer.ring("send")  # as send() does first; then it dies before any tensor goes out
print("joined", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("rang", [False, True])
def test_a_killed_sender_is_an_error_at_once_not_a_hang(rang):
    """Trainer rank 0 (here a process that joins the group) is SIGKILLed, before it starts the refit or during
    it: the receiver, waiting for its doorbell or for its tensors, fails at once. A killed engine during a
    refit: tests/test_faults.py test_dead_engine_stops_the_run_with_a_checkpoint_..."""
    tensors = model_like_tensors()
    group = dataclasses.replace(RefitGroup.offer(tensors.items(), bucket_bytes=100, timeout_s=60), world_size=2,
                                backend="gloo")
    peer_process = subprocess.Popen(
        [sys.executable, "-c", PEER, json.dumps(dataclasses.asdict(group)), "rang" if rang else "silent"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        peer = join(group, 1)
        assert peer_process.stdout.readline().strip() == "joined"
        if rang:
            wait_for_sender(peer)
        os.kill(peer_process.pid, signal.SIGKILL)
        peer_process.wait()
        start = time.monotonic()
        if rang:
            with pytest.raises(RuntimeError, match="refit broadcast failed: a peer of the refit group died"):
                list(receive(peer))
        else:
            with pytest.raises(RuntimeError, match="the sender .trainer rank 0. died before it sent refit 1"):
                wait_for_sender(peer)
        assert time.monotonic() - start < 10, "a dead peer was only noticed at the timeout"
    finally:
        peer_process.kill()
        peer_process.wait()


def test_backend_follows_the_devices_and_rollout_weight_transfer():
    assert refit_backend("auto", None, [None, None]) == "gloo"  # CPU
    assert refit_backend("auto", "GPU-0", ["GPU-1", "GPU-2"]) == "nccl"
    assert refit_backend("auto", "GPU-0", ["GPU-1", "GPU-0"]) == "gloo"  # NCCL refuses two ranks on one GPU
    assert refit_backend("gloo", "GPU-0", ["GPU-1"]) == "gloo"
