"""The capture-hook protocol, re-exported from :mod:`graphrunner.recording.hooks`, where it moved
(below the backends and the checks, which share it): ``from graphrunner.backends.hooks import
CaptureHook`` keeps working."""

from graphrunner.recording.hooks import Capture, CaptureHook, Finding

__all__ = ["Capture", "CaptureHook", "Finding"]
