"""A Megatron-style GPT pretraining framework on PyTorch."""

__version__ = "0.1.0"
