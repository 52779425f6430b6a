"""The one engine every Hugging Face family runs on, both ways (torchtitan's ``state_dict_adapter`` and Megatron
Bridge's mapping registry are the models).

A family is one value, ``Family``: a table of ``Rule``s, each our name and the Hugging Face name(s) it holds with
``{}`` for the layer (and ``{}`` twice for a layer and an expert), read both ways; a ``Transform`` for what is not
a rename (the vocabulary padding, the fused query/key/value split by group, the interleaved gate/up rows, ...);
``Extra``s for the Hugging Face tensors that hold none of our parameters (a gate that must be zero, a copy, a train
state value); and a ``config.json`` key table (``Key``: our ``ModelConfig`` field <-> the key, with a transform
where the value changes). The engine expands the placeholders from the layer count (or the layers a ``Rule``
names: the MoE layers, the dense ones, the multi-token prediction layers) and the expert count; a family file
builds no name in a loop.

- export (``to_hf``): every rule's tensor through its transform, every extra made, every tensor contiguous and in
  its own storage; a rule whose Hugging Face name has one ``{}`` less than ours stacks the experts along dim 0.
- import (``from_hf``): the family's ``prepare`` (prefixes, transformers 5's fused in-memory form), the stacked
  tensors (shape checked), the extras (popped and checked), the names compared with the table, the vocabulary's
  shape, the tied head, then every rule's tensors (fp32) through its transform's inverse.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from megatron.checkpoint.hf.common import ConversionError, check_names, check_vocab_shape
from megatron.config.schema_model import is_norm_weight

# ---------------------------------------------------------------------------------------------------- transforms


@dataclass(frozen=True)
class Ctx:
    """What a transform may read: our ``ModelConfig``, the padded vocabulary (import), the import's options (read off
    config.json: ``Family.options``) and the checkpoint's train state (export)."""
    m: object
    padded_vocab: int = 0
    options: dict = field(default_factory=dict)
    train_state: dict | None = None


@dataclass(frozen=True)
class Transform:
    """A layout change that is not a rename: ``to_hf(t, ctx, ours) -> parts`` (one tensor per Hugging Face name of
    the rule) and its inverse ``from_hf(parts, ctx) -> t`` (the parts fp32)."""
    name: str
    to_hf: Callable
    from_hf: Callable


SAME = Transform("same", lambda t, ctx, ours: [t], lambda parts, ctx: parts[0])


def chain(first: Transform, then: Transform) -> Transform:
    """``first``, then ``then`` on each of its parts (the inverse in the reverse order)."""
    return Transform(f"{first.name}+{then.name}",
                     lambda t, ctx, ours: [then.to_hf(p, ctx, ours)[0] for p in first.to_hf(t, ctx, ours)],
                     lambda parts, ctx: first.from_hf([then.from_hf([p], ctx) for p in parts], ctx))


def per_part(name: str, to_hf: Callable, from_hf: Callable) -> Transform:
    """A transform of one tensor to one tensor: ``to_hf(t, ctx)``, ``from_hf(t, ctx)``."""
    return Transform(name, lambda t, ctx, ours: [to_hf(t, ctx)], lambda parts, ctx: from_hf(parts[0], ctx))


# ------------------------------------------------------------------------------------------------- layer choices


def every_layer(m) -> list[tuple[int, int]]:
    """(our index, Hugging Face's index) of every decoder layer: the same."""
    return [(n, n) for n in range(m.num_layers)]


def layers_where(pattern: Callable) -> Callable:
    """The layers (same index both sides) whose entry of ``pattern(m)`` (a list of booleans) is true."""
    return lambda m: [(n, n) for n, on in enumerate(pattern(m)) if on]


def mtp_layers(m) -> list[tuple[int, int]]:
    """The multi-token prediction layers: ours ``k``, Hugging Face's ``num_layers + k`` (DeepSeek's extra layers)."""
    return [(k, m.num_layers + k) for k in range(m.mtp_num_layers or 0)]


# ----------------------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Rule:
    """Our name -> the Hugging Face name(s) it holds, ``{}`` the layer (then the expert); ``layers(m)``: which
    layers the placeholder takes (default every one); ``when(m)``: whether the model has the tensor at all."""
    ours: str
    theirs: tuple[str, ...]
    transform: Transform = SAME
    layers: Callable = every_layer
    when: Callable | None = None
    shape: Callable | None = None  # a stacked rule's: one expert's Hugging Face shape, ``shape(m)``

    @property
    def stacked(self) -> bool:
        """Whether one Hugging Face tensor holds every expert (one ``{}`` less than ours): stacked along dim 0."""
        return self.ours.count("{}") == 2 and self.theirs[0].count("{}") == 1


BLOCK = Rule("", ())  # in a table: the rules after it are written after those before it, not layer by layer


def rule(ours: str, theirs: str | tuple[str, ...], transform: Transform = SAME, layers: Callable = every_layer,
         when: Callable | None = None, shape: Callable | None = None) -> Rule:
    return Rule(ours, (theirs,) if isinstance(theirs, str) else tuple(theirs), transform, layers, when, shape)


def renames(table: dict[str, str | tuple[str, ...]], transform: Transform = SAME, layers: Callable = every_layer,
            when: Callable | None = None, ours: str = "", theirs: str = "") -> list[Rule]:
    """A rule per entry of ``{our name: Hugging Face name(s)}``, each name after the prefix ``ours`` / ``theirs``."""
    return [rule(ours + a, tuple(theirs + x for x in ((b,) if isinstance(b, str) else b)), transform, layers, when)
            for a, b in table.items()]


@dataclass(frozen=True)
class Extra:
    """A Hugging Face tensor (``{}`` the layer) that holds none of our parameters: ``make(ctx, out, name)`` on export
    (``out`` the tensors exported so far); on import ``check(t, ctx, hf, name)`` of the popped tensor (None when
    absent), which raises ConversionError for one that cannot be imported."""
    theirs: str
    make: Callable
    check: Callable
    layers: Callable = every_layer
    when: Callable | None = None


def _index_pairs(template: str, layers: Callable, m) -> Iterable[tuple]:
    holes = template.count("{}")
    if holes == 0:
        return [((), ())]
    if holes == 1:
        return [((a,), (b,)) for a, b in layers(m)]
    return [((a, i), (b, i)) for (a, b), i in itertools.product(layers(m), range(m.num_experts or 0))]


def _instances(rules: Iterable[Rule], m, stacked: bool) -> list[tuple[tuple, Rule, tuple, tuple]]:
    """(sort key, rule, our indices, their indices) of every rule the model has (stacked ones or the others), in
    the table's order, but a run of rules with ``{}`` layer by layer: in a layer, the rules before the first expert
    rule, then expert by expert the expert rules, then the rest (the order our checkpoints' pieces are written in)."""
    out, runs, position = [], [], 0
    for r in rules:  # runs of rules with ``{}`` or without; BLOCK starts a new one
        position += r is BLOCK or not runs or ("{}" in r.ours) != runs[-1][0]
        if r is not BLOCK:
            runs.append(("{}" in r.ours, position, r))
    for (layered, position), run in itertools.groupby(runs, key=lambda item: item[:2]):
        seen_expert = False
        for index, (_, _, r) in enumerate(run):
            expert = r.ours.count("{}") == 2
            phase, seen_expert = (1 if expert else 2 if seen_expert else 0), seen_expert or expert
            if r.stacked != stacked or (r.when is not None and not r.when(m)):
                continue
            pairs = [(a[:1], b) for a, b in _index_pairs(r.theirs[0], r.layers, m)] if r.stacked else \
                _index_pairs(r.ours, r.layers, m)
            for ours, theirs in pairs:
                layer = ours[0] if layered else 0
                expert_index = ours[1] if expert and not r.stacked else 0
                out.append(((position, layer, phase, expert_index, index), r, ours, theirs))
    return sorted(out, key=lambda item: item[0])


def expand(rules: Iterable[Rule], m) -> dict[str, tuple[list[str], Transform]]:
    """Our name -> (the Hugging Face names, the transform) of every rule that is not stacked, placeholders filled."""
    return {r.ours.format(*ours): ([name.format(*theirs) for name in r.theirs], r.transform)
            for _, r, ours, theirs in _instances(rules, m, stacked=False)}


def expand_stacked(rules: Iterable[Rule], m) -> dict[str, tuple[list[str], Rule]]:
    """A stacked rule's Hugging Face name -> (our names, in expert order; the rule)."""
    return {r.theirs[0].format(*theirs): ([r.ours.format(ours[0], i) for i in range(m.num_experts)], r)
            for _, r, ours, theirs in _instances(rules, m, stacked=True)}


def expand_extras(extras: Iterable[Extra], m) -> list[tuple[str, Extra]]:
    return [(e.theirs.format(*theirs), e) for e in extras if e.when is None or e.when(m)
            for _, theirs in _index_pairs(e.theirs, e.layers, m)]


# --------------------------------------------------------------------------------------------- the config table


@dataclass(frozen=True)
class Key:
    """One ``config.json`` key: ``theirs`` <- our field ``ours`` (``to_hf`` of its value) on export, -> ``ours``
    (``from_hf`` of the key's value, ``default`` when absent) on import. ``export(m)`` instead: a key derived from
    the whole config (or a constant), written; ``read(config)`` instead: our field derived from the whole config.json
    (several keys, or a default that depends on another), read; ``aliases``: other names of the key, read in turn
    when ``theirs`` is absent; ``ours`` None: not read back by the table."""
    theirs: str
    ours: str | None = None
    to_hf: Callable = lambda v: v
    from_hf: Callable = lambda v: v
    default: object = None
    export: Callable | None = None
    read: Callable | None = None
    aliases: tuple[str, ...] = ()

    def value_in(self, config: dict):
        """Our field's value read off ``config`` (``read``, or ``from_hf`` of the first of the key and its aliases
        that ``config`` has, else of ``default``)."""
        if self.read is not None:
            return self.read(config)
        name = next((n for n in (self.theirs, *self.aliases) if n in config), None)
        return self.from_hf(config[name] if name is not None else self.default)


def config_out(keys: Iterable[Key], m) -> dict:
    """config.json's keys of our ``ModelConfig`` ``m``, in the table's order."""
    return {k.theirs: k.export(m) if k.export is not None else k.to_hf(getattr(m, k.ours)) for k in keys}


def config_in(keys: Iterable[Key], config: dict, fields: Iterable[str] | None = None) -> dict:
    """Our fields (name -> value) read off ``config`` by the keys that name one (only ``fields``, in that order, when
    given; else every one, in the table's order)."""
    by_field = {k.ours: k for k in keys if k.ours is not None}
    return {name: by_field[name].value_in(config) for name in (by_field if fields is None else fields)}


# ----------------------------------------------------------------------------------------------------- a family


@dataclass(frozen=True)
class Family:
    """A Hugging Face family, declared: ``rules``, ``extras`` and ``keys`` as above; ``check_model(m)`` refuses a
    model of ours the family cannot hold; ``prepare(hf)`` puts an input state dict in the table's form; ``embedding``
    / ``head``: the Hugging Face names of the word embedding and the LM head, checked for the vocabulary on import
    (``head_tied(m, hf, head)``: what a tied head must be, ConversionError otherwise); ``keeps_fp32``: the names
    (endings) written in fp32 whatever the dtype; ``holds_mtp``: its checkpoints hold multi-token prediction layers
    (``mtp_layers_in(keys, config)`` then says how many a folder's weights hold); ``options(config)``: the import's
    options read off config.json; ``train_state(hf, m)``: the train state an import carries (None: a fresh one)."""
    name: str
    rules: tuple
    keys: tuple
    check_model: Callable
    prepare: Callable
    embedding: str
    head: str
    head_tied: Callable
    extras: tuple = ()
    hint: str = "check num_layers"
    export_hint: str = "check num_layers"
    stack_hint: str = ""
    keeps_fp32: tuple = ()
    holds_mtp: bool = False
    mtp_layers_in: Callable | None = None
    options: Callable = lambda config: {}
    train_state: Callable = lambda hf, m: None
    # zero-centred norms (apply_layernorm_1p) the family stores as 1 + w: None, every norm (its norms scale by w);
    # else the names (endings) of those it stores so, the others being zero-centred on its side too (Qwen3-Next's)
    one_plus_norms: tuple | None = None

    def name_map(self, m) -> dict[str, list[str]]:
        """Our global parameter name -> the Hugging Face name(s) it holds (a stacked tensor's: each expert's)."""
        names = {ours: theirs for ours, (theirs, _) in expand(self.rules, m).items()}
        for theirs, (ours, _) in expand_stacked(self.rules, m).items():
            names.update({name: [theirs] for name in ours})
        return names

    def to_hf_state_dict(self, tensors: dict[str, torch.Tensor], m,
                         train_state: dict | None = None) -> dict[str, torch.Tensor]:
        """Our global tensors (and the checkpoint's train state) -> the family's state dict."""
        self.check_model(m)
        return to_hf(self, tensors, Ctx(m, train_state=train_state))

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], m, padded_vocab: int,
                           **options) -> dict[str, torch.Tensor]:
        """The family's state dict -> our global tensors (fp32, the vocabulary padded to ``padded_vocab`` rows)."""
        self.check_model(m)
        return from_hf(self, self.prepare(hf), Ctx(m, padded_vocab, options))


def _one_plus(tensors: dict[str, torch.Tensor], m, sign: int, only: tuple | None = None) -> dict[str, torch.Tensor]:
    """Zero-centred norm weights (``apply_layernorm_1p``: the norm scales by 1 + w) as Hugging Face's scales
    (``sign`` 1) or back (-1): every norm's, or ``only`` those whose names end so (``Family.one_plus_norms``); the
    tensors as they are otherwise."""
    if not getattr(m, "apply_layernorm_1p", False):
        return tensors
    shifted = is_norm_weight if only is None else (lambda name: name.endswith(only))
    return {name: t + sign if shifted(name) else t for name, t in tensors.items()}


def to_hf(family: Family, tensors: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, torch.Tensor]:
    m, tensors = ctx.m, _one_plus(tensors, ctx.m, 1, family.one_plus_norms)
    plan, stacks = expand(family.rules, m), expand_stacked(family.rules, m)
    want = set(plan) | {name for ours, _ in stacks.values() for name in ours}
    check_names(set(tensors), want, "the checkpoint's tensors", family.export_hint)
    out = {}
    for ours, (theirs, transform) in plan.items():
        parts = transform.to_hf(tensors[ours], ctx, ours)
        out.update({name: part.contiguous().clone() for name, part in zip(theirs, parts)})
    for theirs, (ours, r) in stacks.items():
        out[theirs] = torch.stack([r.transform.to_hf(tensors[name], ctx, name)[0] for name in ours]).contiguous() \
            .clone()
    for name, extra in expand_extras(family.extras, m):
        out[name] = extra.make(ctx, out, name)
    return out


def _unstack(family: Family, hf: dict[str, torch.Tensor], ctx: Ctx, out: dict) -> None:
    """Pop every stacked tensor off ``hf`` (shape checked) into our per-expert tensors in ``out``."""
    for theirs, (ours, r) in expand_stacked(family.rules, ctx.m).items():
        if theirs not in hf:
            raise ConversionError(f"the Hugging Face state dict lacks {theirs!r}; {family.hint}.")
        t, want = hf.pop(theirs).to(torch.float32), (len(ours), *r.shape(ctx.m))
        if tuple(t.shape) != want:
            raise ConversionError(f"{theirs} has shape {list(t.shape)}, expected {list(want)}{family.stack_hint}.")
        out.update({name: r.transform.from_hf([t[i]], ctx).contiguous().clone() for i, name in enumerate(ours)})


def from_hf(family: Family, hf: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, torch.Tensor]:
    m, hf, stacked = ctx.m, dict(hf), {}
    _unstack(family, hf, ctx, stacked)
    for name, extra in expand_extras(family.extras, m):
        extra.check(hf.pop(name, None), ctx, hf, name)
    plan = expand(family.rules, m)
    tied = None if m.untie_embeddings_and_output_weights else hf.pop(family.head, None)
    check_names(set(hf), {name for theirs, _ in plan.values() for name in theirs}, "the Hugging Face state dict",
                family.hint)
    for name in (family.embedding, family.head):
        if name in hf:
            check_vocab_shape(hf[name], name, m.vocab_size, m.hidden_size, ctx.padded_vocab)
    if tied is not None:
        family.head_tied(tied, hf)
    out = {}
    for ours, (theirs, transform) in plan.items():
        out[ours] = transform.from_hf([hf[name].to(torch.float32) for name in theirs], ctx).contiguous().clone()
    return _one_plus({**out, **stacked}, m, -1, family.one_plus_norms)
