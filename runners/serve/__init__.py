"""`kvforge serve`: an OpenAI-compatible HTTP server with continuous batching over one artifact."""

from kvforge.runners.serve.server import ServeOptions, serve

__all__ = ["ServeOptions", "serve"]
