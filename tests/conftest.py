"""Shared pytest configuration: CUDA-marked tests skip on machines without a GPU;
the ``one_torch_thread`` fixture."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module of tiny models (faster than two
    spinning threads on a busy 2-core machine); the caller's count is restored."""
    from graphrunner_tools.threads import torch_threads

    with torch_threads(1):
        yield
