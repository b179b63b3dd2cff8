"""Test support that ships with graphrunner (not imported by the runtime).

- :mod:`graphrunner.testing.cuda_standin`: a stand-in for the parts of
  ``torch.cuda`` graphrunner uses, for CPU-only machines: it binds every call
  to the installed torch's real signatures and enforces the capture and
  private-pool rules of ``CUDAGraph.cpp`` and the CUDA caching allocator,
  with tensors on the CPU and replays through the tape.

The checks of ``scripts/cuda-check.sh`` (real GPU, or ``--dry-run`` on the
stand-in) are a tool: :mod:`graphrunner_tools.cuda_check`.
"""
