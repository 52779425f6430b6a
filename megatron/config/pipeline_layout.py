"""Megatron-LM's pipeline layout strings (``--pipeline-model-parallel-layout``): which layers each (virtual)
pipeline stage holds, written out.

A layout such as ``Et*3|(tt|)*29,m|L`` names the layers of every stage in order: ``E`` the embedding, ``t`` a
transformer (decoder) layer, ``m`` a multi-token prediction layer, ``L`` the loss (final norm and head); ``|``
ends a stage, ``x*n`` repeats one character, ``(...)*n`` repeats a group (no nesting), commas are cosmetic.
With ``pp`` pipeline ranks and ``S`` stages, ``S / pp`` is the number of model chunks per rank (the interleaved
schedule's ``virtual_pp_degree``) and stage ``v`` is chunk ``v // pp`` of rank ``v % pp``: the stages are
listed in the order a micro-batch's forward visits them.

Pure (standard library only), as Megatron Core 0.16.1's ``PipelineParallelLayerLayout`` reads a string: the
same unrolling, the same stages, and its refusals (``parse``, ``check``) as one-sentence ValueErrors. A stage
may hold the embedding alone (``E|...``) or the loss alone (``...|L``); a chunk's decoder layers are its ``t``
counted in forward order. This project also refuses what it cannot place: multi-token prediction layers
anywhere but the last stage (Megatron's "standalone MTP" on an earlier rank) and a stage that holds nothing
(Megatron accepts one, and builds the embedding on the first stage and the loss on the last whatever the
letters' stages; here a chunk without layers is not built: its run left the one-process losses at the third
step), so ``E`` opens the first stage and ``L`` closes the last.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

LETTERS = {"E": "embedding", "t": "transformer layer", "m": "multi-token prediction layer", "L": "loss"}
_CHARACTERS = set(LETTERS) | set("|()*,0123456789")
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")  # (...)*n, unrolled first; the group may hold '|' but no ')'
_SINGLE = re.compile(r"(.)\*(\d+)")  # x*n: any one character, '|' and ')' included
MAX_LENGTH = 1_000_000  # unrolled characters: far beyond any model, short of a typo's exhaustion of memory
_SYNTAX = ("use E (embedding), t (transformer layer), m (multi-token prediction layer), L (loss), '|' between "
           "stages, 'x*n' or '(...)*n' to repeat, ',' anywhere as a separator")


@dataclass(frozen=True)
class PipelineLayout:
    """A parsed layout: ``stages[v]`` the letters of virtual stage ``v = chunk * pp + pp_rank``, unrolled."""

    stages: tuple[str, ...]
    pp: int

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank."""
        return len(self.stages) // self.pp

    def stage(self, pp_rank: int, chunk: int) -> str:
        """The letters of chunk ``chunk`` of pipeline rank ``pp_rank``."""
        if not 0 <= pp_rank < self.pp or not 0 <= chunk < self.vpp:
            raise ValueError(f"pp_rank {pp_rank} / chunk {chunk} out of range for pp={self.pp}, vpp={self.vpp}.")
        return self.stages[chunk * self.pp + pp_rank]

    def decoder_layers(self, pp_rank: int, chunk: int = 0) -> range:
        """The global decoder layers of chunk ``chunk`` of rank ``pp_rank``: the stages' ``t`` counted in order."""
        letters = self.stage(pp_rank, chunk)
        start = sum(s.count("t") for s in self.stages[:chunk * self.pp + pp_rank])
        return range(start, start + letters.count("t"))

    def counts(self, letter: str = "t") -> list[int]:
        """How many ``letter`` each virtual stage holds, in forward order."""
        return [s.count(letter) for s in self.stages]


def looks_like_layout(method: str) -> bool:
    """Whether a ``pipeline_partition`` value is meant as a layout string (it uses a layout's characters only and
    names a stage, ``|``, or a layer letter); the other values are method names and per-stage counts."""
    return bool(method) and set(method) <= _CHARACTERS and any(c in method for c in "|EtmL")


def expand(text: str) -> str:
    """``text`` with the commas dropped and the repetitions unrolled: every ``(...)*n`` first, then every
    ``x*n`` (so ``(t*2|)*2`` is ``tt|tt|``; a repetition left over, as in ``t*2*3``, stays and is refused)."""

    def unroll(match: re.Match) -> str:
        if len(match.group(1)) * int(match.group(2)) > MAX_LENGTH:
            raise ValueError(f"pipeline layout {text!r} unrolls {match.group(0)!r} to more than {MAX_LENGTH} "
                             f"characters: no model has that many layers; check the repetition counts.")
        return match.group(1) * int(match.group(2))

    out = text.replace(",", "")
    for pattern in (_GROUP, _SINGLE):
        out = pattern.sub(unroll, out)
        if len(out) > MAX_LENGTH:
            raise ValueError(f"pipeline layout {text!r} unrolls to more than {MAX_LENGTH} characters: no model "
                             f"has that many layers; check the repetition counts.")
    return out


@functools.lru_cache(maxsize=256)
def parse(text: str, pp: int) -> PipelineLayout:
    """The layout ``text`` over ``pp`` pipeline ranks. ValueError (one sentence) for a character that is not a
    layer letter once the repetitions are unrolled (an unmatched parenthesis, a stray space) or a number of
    stages that is not a multiple of ``pp``, as Megatron refuses them."""
    if pp < 1:
        raise ValueError(f"the pipeline size must be at least 1, got {pp}.")
    stages = tuple(expand(text).split("|"))
    for stage in stages:
        wrong = next((c for c in stage if c not in LETTERS), None)
        if wrong is not None:
            raise ValueError(f"pipeline layout {text!r}: {wrong!r} (in stage {stage!r}) is not a layer letter "
                             f"once the repetitions are unrolled; {_SYNTAX}.")
    if len(stages) % pp:
        raise ValueError(f"pipeline layout {text!r} has {len(stages)} stages, not a multiple of the pipeline size "
                         f"({pp}): give pp x vpp stages (vpp model chunks per rank) separated by '|'.")
    return PipelineLayout(stages, pp)


def layout_chunks(text: str, pp: int, vpp: int, num_layers: int, mtp_num_layers: int | None) -> int:
    """The model chunks per pipeline rank (``virtual_pp_degree``) the layout ``text`` gives over ``pp`` ranks, once
    checked against the model. ``vpp``, the configured one: 1 (the default) takes the layout's; another must
    equal it (Megatron's TransformerConfig asserts the same)."""
    layout = parse(text, pp)
    if vpp not in (1, layout.vpp):
        raise ValueError(f"pipeline layout {text!r} has {len(layout.stages)} stages, {layout.vpp} model chunks on "
                         f"each of the {pp} pipeline ranks, but virtual_pp_degree is {vpp}: drop virtual_pp_degree "
                         f"(the layout sets it) or make the two agree.")
    check(layout, num_layers, mtp_num_layers)
    return layout.vpp


def check(layout: PipelineLayout, num_layers: int, mtp_num_layers: int | None) -> None:
    """Megatron's checks of a layout against the model (``validate_layer_layout``), then this project's own.
    ValueError, one sentence: what is wrong and what to write instead."""
    flat, name = "".join(layout.stages), "|".join(layout.stages)
    if not flat or flat[0] != "E" or flat.count("E") != 1:
        raise ValueError(f"pipeline layout {name!r} must open with the embedding 'E', once (in the first stage).")
    if flat[-1] != "L" or flat.count("L") != 1:
        raise ValueError(f"pipeline layout {name!r} must close with the loss 'L', once (in the last stage).")
    if flat.count("t") != num_layers:
        raise ValueError(f"pipeline layout {name!r} holds {flat.count('t')} transformer layers 't' but num_layers "
                         f"is {num_layers}: make them equal.")
    mtp = flat.count("m")
    if mtp != (mtp_num_layers or 0):
        raise ValueError(f"pipeline layout {name!r} holds {mtp} multi-token prediction layers 'm' but "
                         f"mtp_num_layers is {mtp_num_layers}: make them equal.")
    if mtp and "t" in flat[flat.index("m"):]:
        raise ValueError(f"pipeline layout {name!r} places a transformer layer 't' after a multi-token prediction "
                         f"layer 'm': the 'm' layers come after every 't'.")
    _check_mtp_placement(layout, name, mtp)
    if "E" not in layout.stages[0]:
        raise ValueError(f"pipeline layout {name!r} leaves the first stage without the embedding 'E': the embedding "
                         f"is built on the first stage here; write the layout with 'E' in it.")
    if "L" not in layout.stages[-1]:
        raise ValueError(f"pipeline layout {name!r} leaves the last stage without the loss 'L': the head is built on "
                         f"the last stage here; write the layout with 'L' in it.")


def _check_mtp_placement(layout: PipelineLayout, name: str, mtp: int) -> None:
    """Megatron's: the 'm' layers all in one stage, the last chunk of a rank. Ours: that stage is the last one,
    with the loss, where this project builds multi-token prediction (``pipeline_parallel.partition.cut_stage``)."""
    if not mtp:
        return
    holding = [v for v, stage in enumerate(layout.stages) if "m" in stage]
    if any(v // layout.pp != layout.vpp - 1 for v in holding):
        raise ValueError(f"pipeline layout {name!r} places multi-token prediction layers 'm' in a model chunk "
                         f"other than its rank's last (Megatron's restriction): move them to the last stage.")
    if len(holding) > 1:
        raise ValueError(f"pipeline layout {name!r} spreads the multi-token prediction layers 'm' over stages "
                         f"{holding}: put all of them in one stage, the last.")
    if holding[0] != len(layout.stages) - 1:
        raise ValueError(f"pipeline layout {name!r} places the multi-token prediction layers 'm' on pipeline rank "
                         f"{holding[0] % layout.pp}, before the last: this project builds them on the last stage, "
                         f"with the loss (Megatron's standalone MTP is not built); move them into the last stage.")
