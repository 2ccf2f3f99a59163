"""modelhost: a local LLM inference server with a continuous-batching engine on PyTorch."""

__version__ = "0.1.0"
