"""Shared pytest configuration: CUDA-marked tests skip on machines without a GPU,
``hf``-marked tests skip without transformers (the ``hf`` extra, which the
README's quick start does not install); the ``one_torch_thread`` fixture."""

import pytest
import torch

from extras_util import missing, skip_reason


def pytest_collection_modifyitems(config, items):
    no_gpu = not torch.cuda.is_available()
    no_hf = missing("transformers")
    for item in items:
        if no_gpu and "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif no_hf and item.get_closest_marker("hf") is not None:
            item.add_marker(pytest.mark.skip(reason=skip_reason("transformers")))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module of tiny models (faster than two
    spinning threads on a busy 2-core machine); the caller's count is restored."""
    from graphrunner_tools.threads import torch_threads

    with torch_threads(1):
        yield
