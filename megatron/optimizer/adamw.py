"""AdamW (decoupled weight decay) over the optimizer's flat fp32 master tensors.

The maths and the kernel are torch's: ``torch._fused_adamw_`` on every device that has it (CPU and
CUDA among them), else the same update in torch's ``_foreach`` ops. What it leaves out is
``torch.optim.Optimizer``'s machinery, which this project never used (its hooks, ``state_dict``,
``differentiable``, ``capturable``, amsgrad, complex parameters), and with it a cost: its constructor and
step are wrapped in ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``, about 2 s of CPU
in every process that builds an optimizer, compiled or not.

The interface is the part of ``torch.optim.AdamW`` the mixed-precision optimizer and the checkpoints use:
``param_groups`` (each with ``lr``, ``betas``, ``eps``, ``weight_decay`` and its ``params``), ``state``
(per parameter: ``step``, a float32 scalar tensor on the parameter's device, ``exp_avg``, ``exp_avg_sq``)
and ``step()``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


def has_fused_kernel(device: torch.device) -> bool:
    """Whether torch has its fused AdamW kernel for ``device``'s type."""
    return device.type in _get_fused_kernels_supported_devices()


class AdamW:
    """AdamW over ``param_groups`` (dicts with ``params`` and optionally ``weight_decay``, ``lr`` and any
    other keys, which are kept); parameters without a gradient are left alone. ``fused``: torch's fused
    kernel (the device must have it), else its foreach ops."""

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.01, fused: bool = True):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [{**defaults, **group, "params": list(group["params"])} for group in param_groups]
        self.state: dict[torch.Tensor, dict] = {}
        self.fused = fused
        if fused:
            for group in self.param_groups:
                for p in group["params"]:
                    if not has_fused_kernel(p.device):
                        raise ValueError(f"torch has no fused AdamW kernel for {p.device.type} tensors: "
                                         "pass fused=False")

    def state_for(self, param: torch.Tensor, step: float = 0.0) -> dict:
        """``param``'s state, created (moments zero, at ``step``) if it has none yet."""
        state = self.state.get(param)
        if state is None:
            state = self.state[param] = {
                "step": torch.tensor(float(step), dtype=torch.float32, device=param.device),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
        return state

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            batches: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # one kernel call per device and dtype
            for p in group["params"]:
                if p.grad is not None:
                    batches[(p.device, p.dtype)].append(p)
            for params in batches.values():
                states = [self.state_for(p) for p in params]
                tensors = ([p.grad for p in params], [s["exp_avg"] for s in states],
                           [s["exp_avg_sq"] for s in states], [s["step"] for s in states])
                (_fused_step if self.fused else _foreach_step)(params, *tensors, group)


def _fused_step(params, grads, exp_avgs, exp_avg_sqs, steps, group) -> None:
    beta1, beta2 = group["betas"]
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"], beta1=beta1,
                        beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                        maximize=False)


def _foreach_step(params, grads, exp_avgs, exp_avg_sqs, steps, group) -> None:
    """The update of the fused kernel, in foreach ops (a device without the kernel): decay the weights by
    ``lr * weight_decay``, move both moments, step by the bias-corrected ratio."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    counts = [float(step) for step in steps]  # host values: this path is for devices without the kernel
    step_sizes = [-lr / (1 - beta1 ** n) for n in counts]
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denominators, [(1 - beta2 ** n) ** 0.5 for n in counts])
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)
