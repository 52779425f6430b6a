"""SGD with momentum over the optimizer's flat fp32 master tensors: Megatron-LM's ``--optimizer sgd``.

Megatron builds ``SGD(param_groups, lr, weight_decay, momentum=sgd_momentum)`` (Transformer Engine's or Apex's
FusedSGD, else ``torch.optim.SGD``: the same update), each group's ``weight_decay`` zero for biases and norms.
One step of a parameter ``p`` with gradient ``g``, at ``lr``, weight decay ``wd`` and momentum ``mu``::

    d <- g + wd p                  coupled (L2) weight decay, added to the gradient
    b <- mu b + d                  (the first step: b <- d; no dampening, no Nesterov)
    p <- p - lr b

With ``mu`` 0 there is no buffer: ``p <- p - lr d``. The buffer starts at zero here rather than as a copy of the
first ``d`` (``0 mu + d`` is ``d`` exactly), so a state exists before the first step and a checkpoint can fill it.
The interface is ``adamw.AdamW``'s: ``param_groups`` (``lr``, ``weight_decay``), ``state`` (per parameter: ``step``,
a float32 scalar tensor, which checkpoints read as the optimizer's step count, and ``momentum_buffer`` unless
``mu`` is 0), ``state_for`` and ``step``.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class SGD:
    """SGD over ``param_groups`` (dicts with ``params`` and optionally ``weight_decay``, ``lr`` and any other keys,
    which are kept) at ``momentum``; parameters without a gradient are left alone. torch's foreach ops."""

    def __init__(self, param_groups: list[dict], lr: float, momentum: float, weight_decay: float = 0.0):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self.param_groups = [{**defaults, **group, "params": list(group["params"])} for group in param_groups]
        self.state: dict[torch.Tensor, dict] = {}
        self.momentum = momentum

    def state_for(self, param: torch.Tensor, step: float = 0.0) -> dict:
        """``param``'s state, created (the momentum buffer zero, at ``step``) if it has none yet."""
        state = self.state.get(param)
        if state is None:
            state = self.state[param] = {"step": torch.tensor(float(step), dtype=torch.float32, device=param.device)}
            if self.momentum != 0:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            batches: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # one foreach call per device and dtype
            for p in group["params"]:
                if p.grad is not None:
                    batches[(p.device, p.dtype)].append(p)
            for params in batches.values():
                states = [self.state_for(p) for p in params]
                torch._foreach_add_([s["step"] for s in states], 1)
                _sgd_step(params, [p.grad for p in params], [s.get("momentum_buffer") for s in states], group)


def _sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list, group: dict) -> None:
    """torch.optim.SGD's update (no dampening, no Nesterov) of ``params``; the gradients are left unchanged."""
    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    if wd != 0:
        grads = torch._foreach_add(grads, params, alpha=wd)
    if momentum != 0:
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        grads = buffers
    torch._foreach_add_(params, grads, alpha=-lr)
