"""The step driver and generate loop."""
from .generate import GenerateResult, generate_greedy

__all__ = ["GenerateResult", "generate_greedy"]
