"""What the backends and the checks share, below both: the op recorder and the hook protocol.

- :mod:`graphrunner.recording.ops`: the one op recorder (:class:`~graphrunner.recording.ops.OpRecorder`)
  and its consumers (:class:`~graphrunner.recording.ops.OpConsumer`,
  :class:`~graphrunner.recording.ops.WriteGuard`).
- :mod:`graphrunner.recording.hooks`: how a check attaches to the capture protocol
  (:class:`~graphrunner.recording.hooks.CaptureHook`, :class:`~graphrunner.recording.hooks.Capture`,
  :class:`~graphrunner.recording.hooks.Finding`), and the checks a backend attaches by its own
  switch (:func:`~graphrunner.recording.hooks.provided_check`).

Nothing here imports a backend or a check: the backends run the protocol and call the
hooks, the checks (:mod:`graphrunner.checks`) implement them.
"""
