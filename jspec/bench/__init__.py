"""Request-level benchmarks of jspec: workloads with checkable answers, a continuous-batching runner (closed
and open loop), per-phase costs, the cost-model check, peers (transformers, llama-cpp-python) and reports.

``python -m jspec bench`` runs ``jspec.bench.suite.main``. This package never imports ``models``: checkpoints
come through ``jspec.loaders.model_loader()``.
"""
