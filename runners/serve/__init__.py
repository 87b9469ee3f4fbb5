"""`kvforge serve`: an OpenAI-compatible HTTP server with continuous batching over one artifact."""

from runners.serve.server import ServeOptions, serve

__all__ = ["ServeOptions", "serve"]
