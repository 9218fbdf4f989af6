"""jspec: lossless speculative decoding in JAX.

``jspec.decode.decode`` is the entry point; see README.md. Modules: ``sampling`` (the sampled distribution),
``verify`` (acceptance rules), ``cache`` (index-masked KV cache), ``drafters`` / ``ngram`` (proposers),
``model`` (the model protocol), ``decode`` (the jit-compiled loop), ``cost_model``.
"""

__version__ = "0.1.0"
