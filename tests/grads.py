"""Comparing gradients computed in two fp32 summation orders, with a tolerance from the math."""

from __future__ import annotations

import torch


def assert_grads_close(grads, refs, what: str = "") -> None:
    """``grads`` equal ``refs`` (lists, or dicts by name) up to fp32 summation order.

    Two orders of one fp32 sum differ by a few ulps of the *terms*, not of the result: where the
    true gradient is ~0 (the key part of the QKV bias is exactly 0, since softmax ignores a
    per-query shift of the scores) the computed value is pure round-off of terms the size of the
    other gradients, and its value depends on the CPU's summation order. So the absolute tolerance
    is scaled to the global gradient norm: 1e-6 x |g| (~8 fp32 ulps of it). A wrongly weighted
    micro-batch, a missed reduction or a wrong dropout mask moves gradients by percents of |g|
    and still fails."""
    if isinstance(refs, dict):
        assert grads.keys() == refs.keys()
        names, grads, refs = list(refs), [grads[n] for n in refs], [refs[n] for n in refs]
    else:
        names = [str(i) for i in range(len(refs))]
    assert len(grads) == len(refs)
    norm = float(torch.sqrt(sum((r.double() ** 2).sum() for r in refs)))
    assert norm > 0, "the reference gradients are all zero: the comparison would prove nothing"
    for name, g, r in zip(names, grads, refs):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6 * norm, msg=f"{what} {name}".strip())
