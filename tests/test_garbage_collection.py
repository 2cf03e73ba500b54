"""training.gc_freq: Python's collector never runs inside a step, and collects on every rank at fixed steps."""

import gc

import pytest

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
        assert collections == [1, 1]  # steps 3 and 6, generation 1 only
    finally:
        collector.close()
    assert gc.isenabled()


def test_zero_keeps_python_automatic_collection():
    collector = StepGarbageCollection(gc_freq=0)
    assert gc.isenabled()
    collector.step(50)
    collector.close()
    assert gc.isenabled()
