"""The GPT model."""

from megatron.model.gpt import GPTModel, num_parameters

__all__ = ["GPTModel", "num_parameters"]
