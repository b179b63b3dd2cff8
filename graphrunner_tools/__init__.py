"""graphrunner's tools: the ``graphrunner`` command line and what it runs.

This package sits next to the runtime (``graphrunner``) and uses only its
public modules; the runtime never imports it. It holds:

* :mod:`graphrunner_tools.cli`: the ``graphrunner`` console script
  (``graphrunner demo | verify | loadtest | check | bench``; also
  ``python -m graphrunner_tools``);
* :mod:`graphrunner_tools.models`: the demo Llama-style decoder and its
  tensor-parallel sharding (user code to the runtime, like any model);
* :mod:`graphrunner_tools.demo`, :mod:`~graphrunner_tools.loadtest`,
  :mod:`~graphrunner_tools.spec`: the demo, the continuous-batching load test
  and the speculative verify loop;
* :mod:`graphrunner_tools.bench`: the driver of the benchmark scripts in a
  source checkout's ``bench/`` and the helpers they share;
* :mod:`graphrunner_tools.launch`, :mod:`~graphrunner_tools.threads`: the
  multi-rank tools' ranks (started by torch's elastic launcher, or joined
  from torchrun's environment) and the CLI's thread count.
"""
