"""Shared pytest configuration.

- ``$GRAPHRUNNER_DEVICE`` is ``tape`` for the whole suite (unless already set), so
  ``device="auto"`` means the tape even on a GPU machine; a test marked ``cuda`` sees it unset
  ("auto" is then CUDA where there is a GPU).
- ``cuda``-marked tests skip on machines without a GPU, unless they take the ``cuda_device``
  or ``cuda_standin`` fixture: those run on the CUDA stand-in
  (:mod:`graphrunner.testing.cuda_standin`) there, and on the real GPU where there is one
  (``cuda_device``).
- ``hf``-marked tests skip without transformers (the ``hf`` extra, which the README's quick
  start does not install).
- The ``one_torch_thread`` fixture.
"""

import os

import pytest
import torch
from extras_util import missing, skip_reason

os.environ.setdefault("GRAPHRUNNER_DEVICE", "tape")

_REAL_GPU = torch.cuda.is_available()
_STANDIN_FIXTURES = ("cuda_device", "cuda_standin")


def pytest_collection_modifyitems(config, items):
    no_hf = missing("transformers")
    for item in items:
        if (
            "cuda" in item.keywords
            and not _REAL_GPU
            and not any(f in getattr(item, "fixturenames", ()) for f in _STANDIN_FIXTURES)
        ):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif no_hf and item.get_closest_marker("hf") is not None:
            item.add_marker(pytest.mark.skip(reason=skip_reason("transformers")))


@pytest.fixture(autouse=True)
def _auto_device_for_cuda_tests(request, monkeypatch):
    """A ``cuda``-marked test sees ``$GRAPHRUNNER_DEVICE`` unset: ``device="auto"`` is CUDA there."""
    if request.node.get_closest_marker("cuda") is not None:
        monkeypatch.delenv("GRAPHRUNNER_DEVICE", raising=False)
    yield


@pytest.fixture
def cuda_standin():
    """A fresh CUDA stand-in installed in ``torch.cuda`` for the test (uninstalled after it);
    skips on a machine with a real GPU, where the stand-in would hide it."""
    if _REAL_GPU:
        pytest.skip("the CUDA stand-in is for machines without a GPU")
    import graphrunner.devices as devices
    from graphrunner.testing.cuda_standin import CudaStandin

    standin = CudaStandin(num_devices=2)
    saved = devices._ALLOCATOR_MID_CAPTURE
    devices._ALLOCATOR_MID_CAPTURE = None  # a new stand-in is a new process: a healthy allocator
    try:
        with standin.installed():
            yield standin
    finally:
        devices._ALLOCATOR_MID_CAPTURE = saved


@pytest.fixture
def cuda_device(request):
    """A ``CudaDevice``: on the real GPU where there is one, else on a fresh CUDA stand-in
    (tensors on ``device.torch_device``, the CPU there)."""
    from graphrunner.devices import CudaDevice

    if _REAL_GPU:
        yield CudaDevice()
        return
    standin = request.getfixturevalue("cuda_standin")
    yield CudaDevice()
    del standin


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module of tiny models (faster than two
    spinning threads on a busy 2-core machine); the caller's count is restored."""
    from graphrunner_tools.threads import torch_threads

    with torch_threads(1):
        yield
