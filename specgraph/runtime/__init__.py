"""The step driver and generate loop."""
from .generate import GenerateResult, Sampling, speculative_generate

__all__ = ["GenerateResult", "Sampling", "speculative_generate"]
