"""The op recorder, re-exported from :mod:`graphrunner.recording.ops`, where it moved (below the
backends, which run it): ``from graphrunner.checks.ops import OpRecorder`` keeps working."""

from graphrunner.recording.ops import (ATOMIC_FUNCTIONS, FunctionEvent, OpConsumer, OpEvent, OpRecorder,
                                       RecordingDevice, WriteGuard, mark_no_graph_code, no_graph_code, op_stream,
                                       storage_key, tensors_in, written_tensors)

__all__ = ["OpEvent", "FunctionEvent", "op_stream", "OpConsumer", "OpRecorder", "RecordingDevice", "WriteGuard",
           "storage_key", "written_tensors", "tensors_in", "no_graph_code", "mark_no_graph_code", "ATOMIC_FUNCTIONS"]
