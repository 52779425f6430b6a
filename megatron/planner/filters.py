"""Which layouts a search may consider: ``--only AXIS=V1,V2`` keeps the layouts whose AXIS is one of the values,
``--exclude AXIS=V1,V2`` drops them; both repeat (every condition must hold), ``--no-offload`` is ``--exclude
offload=on`` and ``--no-cp`` ``--only cp=1``. The axes (``layout.AXES``, the values ``Layout.axes`` gives):

- whole numbers: tp, cp, pp, vpp, dp, sharding (the sharding degree, ``--sharding``), zero (the ZeRO stage, 0 for
  an unsharded optimizer), mb (the micro-batch size), ep, etp (the experts' tensor-parallel size);
- cp-comm: p2p, all_gather, a2a; offload: on, off; recompute: off, core_attn, only_attn, full, block.

A filter is applied to each candidate before it is validated, so a narrow search is also a fast one. A bad
filter is a ``ValueError`` of one sentence (the tool exits 2 with it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megatron.planner.layout import AXES, Layout

NAMED_VALUES = {"cp-comm": ("p2p", "all_gather", "a2a"), "offload": ("on", "off"),
                "recompute": ("off", "core_attn", "only_attn", "full", "block")}


@dataclass(frozen=True)
class AxisFilter:
    """One condition: ``keep`` True (``--only``) keeps the layouts whose ``axis`` is in ``values``, False
    (``--exclude``) drops them."""

    axis: str
    values: frozenset
    keep: bool

    def accepts(self, axes: dict[str, int | str]) -> bool:
        return (axes[self.axis] in self.values) == self.keep

    def describe(self) -> str:
        shown = ",".join(str(v) for v in sorted(self.values, key=str))
        return f"--{'only' if self.keep else 'exclude'} {self.axis}={shown}"


def parse_filter(text: str, keep: bool) -> AxisFilter:
    """``AXIS=V1,V2`` (the text after ``--only`` or ``--exclude``) as a filter; ValueError (one sentence) if it
    names no axis, an unknown one or a value the axis cannot take."""
    flag = "--only" if keep else "--exclude"
    axis, sep, values = text.partition("=")
    axis = axis.strip().lower().replace("_", "-")
    if not sep or not values.strip():
        raise ValueError(f"{flag} takes AXIS=V1,V2 (e.g. {flag} tp=1,2), got {text!r}")
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r} in {flag} {text}: the axes are {', '.join(AXES)}")
    parsed = set()
    for value in (v.strip() for v in values.split(",")):
        if axis in NAMED_VALUES:
            if value not in NAMED_VALUES[axis]:
                raise ValueError(f"{flag} {text}: {axis} takes {', '.join(NAMED_VALUES[axis])}, not {value!r}")
            parsed.add(value)
        elif value.isdigit():
            parsed.add(int(value))
        else:
            raise ValueError(f"{flag} {text}: {axis} takes whole numbers (e.g. {axis}=1,2), not {value!r}")
    return AxisFilter(axis, frozenset(parsed), keep)


def layout_filters(only: Iterable[str] = (), exclude: Iterable[str] = (), no_offload: bool = False,
                   no_cp: bool = False) -> tuple[AxisFilter, ...]:
    """The filters of the tool's flags (``--only`` and ``--exclude`` texts, ``--no-offload``, ``--no-cp``)."""
    filters = [parse_filter(t, True) for t in only] + [parse_filter(t, False) for t in exclude]
    filters += [AxisFilter("offload", frozenset({"on"}), False)] if no_offload else []
    filters += [AxisFilter("cp", frozenset({1}), True)] if no_cp else []
    return tuple(filters)


def allows(filters: tuple[AxisFilter, ...], axis: str, value: int | str) -> bool:
    """Whether the filters on ``axis`` let ``value`` through (the search prunes its loops with this)."""
    return all(f.accepts({axis: value}) for f in filters if f.axis == axis)


def accepts(layout: Layout, filters: tuple[AxisFilter, ...]) -> bool:
    """Whether ``layout`` passes every filter."""
    if not filters:
        return True
    axes = layout.axes()
    return all(f.accepts(axes) for f in filters)
