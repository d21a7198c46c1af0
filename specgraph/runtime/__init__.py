"""The step driver and generate loop."""
from .generate import GenerateResult, Sampling, generate_greedy

__all__ = ["GenerateResult", "Sampling", "generate_greedy"]
