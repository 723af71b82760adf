"""Megatron-LM's `megatron.training` package, reduced to its argument parsing (README.md)."""
