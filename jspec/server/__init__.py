"""An OpenAI-compatible HTTP server over ``jspec.serve.Engine`` (``python -m jspec serve``; docs/serving.md).

One module per concern: ``config`` (static settings), ``schema`` (request bodies checked field by field),
``worker`` (the engine's thread, the only one touching the device), ``responses`` (OpenAI's response and
stream formats), ``metrics`` (Prometheus), ``app`` (the routes), ``launch`` (the command, and building a server
in a process that holds a model already).
"""

from jspec.server.config import ServerConfig
from jspec.server.launch import Server, ServerThread, build_server

__all__ = ["Server", "ServerConfig", "ServerThread", "build_server"]
