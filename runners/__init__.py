"""Run-time package: load a compiled artifact and generate text. Imports without torch."""

from runners.engine import Engine, GenerationStats, TextStream
from runners.errors import KvforgeError
from runners.sampling import SamplingParams

__all__ = ["Engine", "GenerationStats", "KvforgeError", "SamplingParams", "TextStream"]
