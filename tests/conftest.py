"""Shared fixtures: one local Ray for the whole test session (engines and actor ranks are started per
module by the tests that need them, and stopped at the module's end), and an asyncio loop per module for
the tests that drive async servers from sync code."""

import asyncio

import pytest
import ray


@pytest.fixture(scope="session")
def local_ray():
    # address="local": a fresh instance even if a `ray start` cluster runs on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
