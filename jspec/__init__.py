"""jspec: lossless speculative decoding in JAX.

``jspec.decode`` is the entry point (``decode``, ``decode_stream``, ``prepare``). The modules, from the API down:

- ``decode``: the public API; ``validate``: every host-side check of a request (decode, serve and the CLI call it).
- ``loop``: prefill and the ``lax.while_loop`` of rounds; ``rounds``: one round's draft and verification, chain and
  tree; ``state``: the loop's config, state and output types; ``stream``: stepping the rounds from Python.
- ``verify`` (chain acceptance rules), ``tree`` (candidate trees and their verification), ``sampling`` (the
  distribution that is sampled), ``cache`` (the index-masked KV cache), ``adaptive`` (per-row draft length).
- ``model`` (the model protocol), ``drafters`` (the drafter protocol and a draft model), ``ngram`` (prompt lookup).
- ``serve`` (continuous batching), ``stop`` (stop strings), ``cost_model`` (the seed's speed-up model).
- ``loaders``, ``cli`` (``python -m jspec``), ``bench`` (benchmarks). jspec never imports ``models`` or ``sharding``.
"""

__version__ = "0.1.0"
