"""The step driver, the generate loop and the continuous stream of plain decoding."""
from .generate import GenerateResult, Sampling, speculative_generate
from .stream import stream_generate

__all__ = ["GenerateResult", "Sampling", "speculative_generate", "stream_generate"]
