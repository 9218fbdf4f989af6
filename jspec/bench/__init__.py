"""Benchmarks of jspec, one module per concern.

- The headline grid of speculative against plain decoding (``grid``), the result file every benchmark command
  writes (``record``), and the README table and docs/results.md rendered from the committed ones (``render``).
- Request-level benchmarks: ``workloads`` (prompt sets with checkable answers), ``targets`` (the checkpoint
  served), ``runspec`` (a run's configuration, load, jobs and result), ``runner`` (the continuous-batching
  runner in closed and open loop), ``metrics`` (request statistics, environment, memory), ``phase_costs`` (each
  phase of a round timed), ``checks`` (quality and the cost-model check), ``suite_runs`` (a suite's runs in
  interleaved passes), ``peers``, ``peer_transformers``, ``peer_llama_cpp`` and ``suite_peers`` (transformers and
  llama-cpp-python on the same checkpoint), ``ratios`` (when a ratio between two runs is given), ``headlines``,
  ``tables``, ``report`` (JSON and Markdown), ``plotting``, ``serving_record`` (their result file) and ``args``
  (the shared flags); ``suite`` is the default suite.

``python -m jspec bench`` runs ``jspec.bench.suite.main``, ``python -m jspec report`` ``jspec.bench.render.main``.
This package never imports ``models``: checkpoints come through ``jspec.loaders.model_loader()``.
"""
