"""Benchmarks of jspec: the headline grid of speculative against plain decoding (``grid``), request-level
benchmarks (workloads with checkable answers, a continuous-batching runner in closed and open loop, per-phase
costs, the cost-model check, peers: transformers, llama-cpp-python), the result file every benchmark command
writes (``record``), and the README table and docs/results.md rendered from the committed ones (``render``).

``python -m jspec bench`` runs ``jspec.bench.suite.main``, ``python -m jspec report`` ``jspec.bench.render.main``.
This package never imports ``models``: checkpoints come through ``jspec.loaders.model_loader()``.
"""
