"""kvbench: benchmark and profiling harness for LLM KV-cache management."""

__version__ = "0.1.0"
