"""training.gc_freq: Python's collector never runs inside a step, and collects on every rank at fixed steps."""

import gc
import weakref

import pytest
import torch

from components.garbage_collection import StepGarbageCollection


@pytest.fixture
def collections():
    seen = []

    def callback(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    yield seen
    gc.callbacks.remove(callback)


def test_collects_only_at_the_chosen_steps(collections):
    assert gc.isenabled()
    collector = StepGarbageCollection(gc_freq=3)
    try:
        assert not gc.isenabled()
        collections.clear()  # the clean start at construction
        for step in range(1, 8):
            # garbage that the automatic collector would have collected many times over
            for _ in range(20_000):
                a = []
                a.append(a)
            collector.step(step)
        assert not gc.isenabled()
        del a
        # generation 0 between steps, generation 1 at steps 3 and 6, never a full collection
        assert collections == [0, 1, 0, 0, 1, 0]
    finally:
        collector.close()
    assert gc.isenabled()


def test_zero_keeps_python_automatic_collection():
    collector = StepGarbageCollection(gc_freq=0)
    assert gc.isenabled()
    collector.step(50)
    collector.close()
    assert gc.isenabled()


def test_a_cycle_holding_a_tensor_is_freed_at_the_next_step():
    """With the automatic collector off, a step's cyclic garbage (e.g. a closure that keeps its activations) must
    not hold memory until the next gc_freq step."""
    collector = StepGarbageCollection(gc_freq=50)
    try:
        holder = {"activations": torch.zeros(1024)}
        holder["self"] = holder
        freed = weakref.ref(holder["activations"])
        del holder
        assert freed() is not None  # only a collection can free a cycle
        collector.step(2)  # not a gc_freq step
        assert freed() is None
    finally:
        collector.close()
