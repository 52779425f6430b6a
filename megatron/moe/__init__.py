"""Mixture of experts (docs/moe.md): the router (``router``), the experts (``experts``), the layer that replaces
the MLP (``layer``), and what a training step does around them (``stats``). One expert-parallel rank for now."""

from megatron.moe.experts import Experts
from megatron.moe.layer import MoELayer
from megatron.moe.router import AuxLossScaler, TopKRouter, set_aux_loss_scale
from megatron.moe.stats import after_step, before_step, expert_biases, moe_layers, set_expert_biases

__all__ = ["AuxLossScaler", "Experts", "MoELayer", "TopKRouter", "after_step", "before_step", "expert_biases",
           "moe_layers", "set_aux_loss_scale", "set_expert_biases"]
