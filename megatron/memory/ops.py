"""What the model's norms save for the backward: the one op every part of the activation model uses (the layer's
norms, the QK norms, multi-latent attention's latent norms, multi-token prediction's input norms), so it is
written once. Sizes as ``megatron.memory.activations`` names them (``D``: its ``Dims``).

- LayerNorm: its input (``rows x width x d``) and the mean and rstd per row (``st`` bytes each: ``d`` on the CPU,
  4 on GPUs);
- RMSNorm (``torch.nn.RMSNorm``, computed in fp32): the fp32 input (the input itself in fp32, else a copy,
  ``4 rows width``), the normalised fp32 ``x rstd`` (``4 rows width``) and the fp32 rstd (``4 rows``).

The input itself is a storage the norm shares with whoever made it: when it is a view of a larger tensor the whole
storage stays alive (``input_bytes``), and when another op already keeps it, it costs nothing more (0). An fp32 copy
(RMSNorm in bf16/fp16) is always the norm's own.
"""

from __future__ import annotations


def saves_input_itself(D) -> bool:
    """Whether a norm saves its input tensor (LayerNorm; RMSNorm in fp32) rather than an fp32 copy."""
    return not D.rmsnorm or D.d == 4


def norm_bytes(D, rows: int, width: int | None = None, input_bytes: int | None = None) -> int:
    """A norm's saves over ``rows`` vectors of ``width`` channels (default the hidden size ``h``).
    ``input_bytes``: what the input itself costs when the norm keeps it (default ``rows x width x d``; the whole
    storage of which it is a view; 0 when another op keeps it already)."""
    width = D.h if width is None else width
    own = rows * width * D.d if input_bytes is None else input_bytes
    if D.rmsnorm:
        return (own if saves_input_itself(D) else 4 * rows * width) + 4 * rows * width + 4 * rows
    return own + 2 * rows * D.stat
