"""The layer-cutting rules: which decoder layers each pipeline stage, and each interleaved model chunk, holds;
and which layers recompute together (``recompute_plan``).

Pure (standard library only) and part of the configuration: ``validate`` refuses a layout the rule cannot
cut, and the model builder, the memory estimator and the layout planner cut by the same rule.

The model is a flat list of ``num_layers + 3`` items: item 0 is the embedding, items ``1..L`` are the
``L`` decoder layers, item ``L + 1`` is the final LayerNorm and item ``L + 2`` the (tied) LM head. A
segmentation is the list of ``num_stages + 1`` item boundaries: stage ``s`` holds items
``boundaries[s]:boundaries[s + 1]``; the first boundary is 0, the last ``num_layers + 3``.

Whatever the method there can be no more stages than decoder layers, every stage holds at least one item,
the embedding is on the first stage and the head on the last. With the default and the explicit methods every
stage also holds at least one decoder layer and the final norm is on the last stage, with the head; "uniform"
may leave the last stage(s) without a decoder layer and put the norm on the stage before the head's.

A Megatron-LM layout string (``pipeline_layout``: ``E|tt|ttL``) names each (virtual) stage's layers itself: a
stage may then hold the embedding alone or the norm and head alone, and under the interleaved schedule the
chunks may differ in size. ``rank_chunks`` is the one rule every reader (the model builder, the memory
estimate, the planner) cuts a rank's chunks by.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.config import pipeline_layout

DEFAULT_METHOD = "layer:TransformerDecoderLayer"


def _even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes differing by at most one; the earlier parts get the extra ones."""
    return [total // parts + (1 if p < total % parts else 0) for p in range(parts)]


def _parse_counts(method: str | Sequence[int]) -> list[int] | None:
    """Explicit per-stage layer counts ("2,3,3" or [2, 3, 3]), or None when ``method`` is not such a list."""
    if isinstance(method, str):
        try:
            return [int(tok) for tok in method.split(",")]
        except ValueError:
            return None
    return [int(c) for c in method]


def segment(num_layers: int, num_stages: int, method: str | Sequence[int] = DEFAULT_METHOD) -> list[int]:
    """The ``num_stages + 1`` boundaries of the flat item list (length ``num_layers + 3``).

    Methods:

    * ``"layer:TransformerDecoderLayer"`` (default, FleetX's): the decoder layers are spread as evenly as
      possible; when ``num_layers`` is not divisible by ``num_stages`` the *earlier* stages get one layer
      more. The embedding is added to the first stage, the final norm and the head to the last.
      4 layers over 2 stages give ``[0, 3, 7]``.
    * ``"uniform"``: all ``num_layers + 3`` items are split as evenly as possible, the earlier stages
      getting one item more; the embedding stays first and the head last, but the last stage may hold only
      the norm and the head, or the head alone (the norm then ends the stage before): 5 layers over 5 stages
      give ``[0, 2, 4, 6, 7, 8]``.
    * explicit per-stage decoder-layer counts, ``"2,3,3"`` or ``[2, 3, 3]``: one count per stage, each
      at least 1, summing to ``num_layers``; the embedding goes to the first stage, norm and head to the last.

    * a layout string, ``"E|tttt|L"`` (``pipeline_layout``; one chunk per stage here): each stage's decoder
      layers as it counts them, none allowed; the embedding first, norm and head last (``[0, 1, 5, 7]``).

    Raises ValueError for fewer than one stage or layer, more stages than decoder layers, wrong counts,
    or an unknown method.
    """
    if isinstance(method, str) and pipeline_layout.looks_like_layout(method):
        return _boundaries(_layout_counts(num_layers, num_stages, method))
    if num_layers < 1 or num_stages < 1:
        raise ValueError(f"num_layers ({num_layers}) and the number of pipeline stages ({num_stages}) must be "
                         f">= 1.")
    if num_stages > num_layers:
        raise ValueError(f"Cannot cut {num_layers} decoder layers into {num_stages} pipeline stages: every stage "
                         f"needs at least one layer; lower pp_degree to at most {num_layers} or add layers.")
    num_items = num_layers + 3
    if method == "uniform":
        sizes = _even(num_items, num_stages)
    else:
        if method == DEFAULT_METHOD:
            counts = _even(num_layers, num_stages)
        else:
            counts = _parse_counts(method)
            if counts is None:
                raise ValueError(f"Unknown pipeline segmentation method {method!r}: use '{DEFAULT_METHOD}', "
                                 f"'uniform', per-stage decoder-layer counts such as '2,3,3', or a layout "
                                 f"string such as 'Et|ttL'.")
            if len(counts) != num_stages:
                raise ValueError(f"Got {len(counts)} per-stage layer counts {counts} for {num_stages} pipeline "
                                 f"stages: give exactly one count per stage.")
            if min(counts) < 1:
                raise ValueError(f"Per-stage layer counts {counts} contain a count below 1: every pipeline "
                                 f"stage must hold at least one decoder layer.")
            if sum(counts) != num_layers:
                raise ValueError(f"Per-stage layer counts {counts} sum to {sum(counts)}, not to num_layers "
                                 f"({num_layers}): make them add up to the number of decoder layers.")
        return _boundaries(counts)
    boundaries = [0]
    for size in sizes:
        boundaries.append(boundaries[-1] + size)
    return boundaries


def _boundaries(counts: Sequence[int]) -> list[int]:
    """The item boundaries of per-stage decoder-layer counts: the embedding first, the norm and the head last."""
    sizes = list(counts)
    sizes[0] += 1  # the embedding
    sizes[-1] += 2  # the final norm and the head
    boundaries = [0]
    for size in sizes:
        boundaries.append(boundaries[-1] + size)
    return boundaries


def _layout_counts(num_layers: int, pp: int, text: str) -> list[int]:
    """Each stage's decoder layers under a layout of one chunk per stage (ValueError where it is not one)."""
    layout = pipeline_layout.parse(text, pp)
    if layout.vpp != 1:
        raise ValueError(f"pipeline layout {text!r} has {len(layout.stages)} stages, {layout.vpp} model chunks "
                         f"per pipeline rank: that is the interleaved schedule's (virtual_pp_degree {layout.vpp}).")
    if sum(layout.counts()) != num_layers:
        raise ValueError(f"pipeline layout {text!r} holds {sum(layout.counts())} transformer layers 't' but "
                         f"num_layers is {num_layers}: make them equal.")
    return layout.counts()


def rank_chunks(num_layers: int, pp: int, vpp: int, method: str, pp_rank: int) -> list[tuple[range, bool, bool]]:
    """(global decoder layers, holds the embedding, holds the head) of each model chunk of pipeline rank
    ``pp_rank`` of ``pp``: the whole model without pipelining; its stage (``segment`` by ``method``); its ``vpp``
    chunks under the interleaved schedule, cut by ``chunk_layers`` or by a layout string's stages. The one rule
    the model builder, the memory estimate and the planner read."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is out of range for pp={pp}.")
    if pp == 1:
        return [(range(num_layers), True, True)]
    first, last = pp_rank == 0, pp_rank == pp - 1
    if pipeline_layout.looks_like_layout(method):
        layout = pipeline_layout.parse(method, pp)
        if layout.vpp != vpp or sum(layout.counts()) != num_layers:
            raise ValueError(f"pipeline layout {method!r} over {pp} ranks gives {layout.vpp} chunks per rank and "
                             f"{sum(layout.counts())} transformer layers, not {vpp} and {num_layers}.")
        return [(layout.decoder_layers(pp_rank, c), first and c == 0, last and c == vpp - 1) for c in range(vpp)]
    if vpp == 1:
        return [(stage_layers(segment(num_layers, pp, method), pp_rank), first, last)]
    return [(chunk_layers(num_layers, pp, vpp, pp_rank, c), first and c == 0, last and c == vpp - 1)
            for c in range(vpp)]


def _check_stage(boundaries: Sequence[int], stage: int) -> None:
    if not 0 <= stage < len(boundaries) - 1:
        raise ValueError(f"Stage {stage} is out of range: this segmentation has {len(boundaries) - 1} stages.")


def stage_layers(boundaries: Sequence[int], stage: int) -> range:
    """The decoder layers (0-based, global indices) on ``stage``; decoder layer ``i`` is item ``i + 1``."""
    _check_stage(boundaries, stage)
    num_layers = boundaries[-1] - 3
    first = max(boundaries[stage], 1)
    last = min(boundaries[stage + 1], num_layers + 1)
    return range(first - 1, max(last, first) - 1)


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, chunk: int) -> range:
    """The decoder layers of model chunk ``chunk`` of pipeline stage ``pp_rank`` (interleaved schedule).

    Megatron-LM's assignment: the layers are cut into ``pp * vpp`` equal consecutive chunks and model chunk
    ``c`` of stage ``r`` holds chunk number ``c * pp + r``. Requires ``num_layers % (pp * vpp) == 0``. The
    embedding belongs to chunk 0 of stage 0, the final norm and the head to chunk ``vpp - 1`` of stage
    ``pp - 1``.
    """
    if pp < 1 or vpp < 1:
        raise ValueError(f"pp ({pp}) and vpp ({vpp}) must both be >= 1.")
    if num_layers % (pp * vpp) != 0:
        raise ValueError(f"The interleaved schedule needs num_layers ({num_layers}) divisible by "
                         f"pp x vpp ({pp} x {vpp} = {pp * vpp}): change num_layers, pp_degree or "
                         f"virtual_pp_degree.")
    if not 0 <= pp_rank < pp or not 0 <= chunk < vpp:
        raise ValueError(f"pp_rank {pp_rank} / chunk {chunk} out of range for pp={pp}, vpp={vpp}.")
    size = num_layers // (pp * vpp)
    index = chunk * pp + pp_rank
    return range(index * size, (index + 1) * size)


def recompute_plan(layers: range, granularity: str | None, skip: list[int] | None, method: str | None,
                   num_layers: int | None) -> tuple[dict[int, str | None], list[list[int]]]:
    """(each layer's own recompute granularity, the layers cut into units run in order).

    Without ``method``: every layer not in ``skip`` recomputes at ``granularity``, each on its own.
    With ``method`` (granularity ``full``, Megatron-LM's rules, per model chunk): ``uniform`` checkpoints
    each run of ``num_layers`` consecutive layers as one unit (only the unit's input is kept);
    ``block`` recomputes the first ``num_layers`` layers of the chunk, each on its own, and the others
    not at all. Units of several layers are checkpointed by ``GPTModel.hidden_states``; a layer alone
    in its unit by itself."""
    skip, num_layers = set(skip or []), num_layers or 1
    if granularity is None or method is None:
        return {i: None if granularity is None or i in skip else granularity for i in layers}, [[i] for i in layers]
    if granularity != "full":
        raise ValueError(f"recompute_method {method!r} needs recompute granularity 'full', got {granularity!r}")
    if method == "block":
        return {i: "full" if n < num_layers else None for n, i in enumerate(layers)}, [[i] for i in layers]
    if method != "uniform":
        raise ValueError(f"unknown recompute_method {method!r}")
    units = [list(layers[n:n + num_layers]) for n in range(0, len(layers), num_layers)]
    # a unit of one layer (num_layers 1, or the chunk's last unit) is that layer's own full recompute
    return {i: "full" if len(unit) == 1 else None for unit in units for i in unit}, units
