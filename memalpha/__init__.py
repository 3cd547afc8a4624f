"""memalpha: train memory-construction agents with GRPO (Mem-alpha, arXiv 2509.25911)."""

__version__ = "0.1.0"
