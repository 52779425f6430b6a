"""The GPT model."""

from megatron.model.gpt import GPTModel, build_model, num_parameters

__all__ = ["GPTModel", "build_model", "num_parameters"]
