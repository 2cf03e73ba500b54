"""Test options: slow multi-process cases run with --runslow (or -m slow); GPU tests skip without CUDA."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def parity_reference(tmp_path_factory):
    """The one-process run of tests.parity.PARITY_ARGS (fp32, gloo): every layout test compares with it, so it runs
    once per session."""
    from tests.parity import PARITY_ARGS, run_training

    return run_training(1, PARITY_ARGS, tmp_path_factory.mktemp("parity_reference"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


# Run after every other test: they record the kernel launches it compiles for sm_90 (tests/triton_sm90.py's
# SESSION_LAUNCHES), which it otherwise reruns under the interpreter (~130 s on the CI's two cores).
RUN_LAST = ("tests/test_kernels_compile_sm90.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.startswith(RUN_LAST))  # stable: the order within each part stays
    if config.getoption("--runslow") or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
