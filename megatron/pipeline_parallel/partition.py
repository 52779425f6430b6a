"""FleetX's segmentation log (``_segment_network``) of a pipeline's stages; the rule that cuts the layers
is ``megatron.config.layer_split``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

LOSS_NAME = "GPTPretrainingCriterionPipe"


def segmentation_log(boundaries: Sequence[int], descriptions: Sequence[str],
                     stage_owner_ranks: Sequence[int]) -> list[str]:
    """FleetX's ``_segment_network`` log lines for a segmentation.

    ``descriptions[i]`` describes item ``i``; ``stage_owner_ranks[s]`` is the global rank owning stage ``s``
    (tensor/data-parallel coordinate 0). ``layer_number`` is the number of items on the stage; the odd
    spacing ``" ,layer_number"`` is FleetX's.
    """
    num_stages = len(boundaries) - 1
    if len(descriptions) != boundaries[-1]:
        raise ValueError(f"Got {len(descriptions)} item descriptions for {boundaries[-1]} items: give one "
                         f"description per item.")
    if len(stage_owner_ranks) != num_stages:
        raise ValueError(f"Got {len(stage_owner_ranks)} stage owner ranks for {num_stages} stages: give one "
                         f"rank per stage.")
    lines = ["start segment network..", "segment result:" + ", ".join(str(b) for b in boundaries)]
    for stage in range(num_stages):
        start, end = boundaries[stage], boundaries[stage + 1]
        lines.append(f"stage={stage}, global_rank={stage_owner_ranks[stage]} ,layer_number={end - start}")
        lines.extend(f"{i}: {descriptions[i]}" for i in range(start, end))
    lines.append(f"loss: {LOSS_NAME}")
    return lines


def item_descriptions(cfg_model: Any, padded_vocab_size: int) -> list[str]:
    """FleetX-style descriptions of the ``num_layers + 3`` items of a ``megatron.config.schema.ModelConfig``.

    ``act_dropout`` is 0.0: unlike FleetX's layer, this model's MLP has no dropout after the activation.
    """
    h = cfg_model.hidden_size
    ffn = cfg_model.ffn_hidden_size or 4 * h
    drop, attn_drop = cfg_model.hidden_dropout_prob, cfg_model.attention_probs_dropout_prob
    embedding = (f"EmbeddingPipe(vocab_size={padded_vocab_size}, hidden_size={h}, hidden_dropout_prob={drop}, "
                 f"max_position_embeddings={cfg_model.max_position_embeddings}, "
                 f"type_vocab_size={cfg_model.type_vocab_size}, initializer_range={cfg_model.initializer_range})")
    activation = "swiglu" if getattr(cfg_model, "swiglu", False) else "gelu"
    groups = (f", num_query_groups={cfg_model.num_query_groups}"
              if getattr(cfg_model, "group_query_attention", False) else "")
    layer = (f"TransformerDecoderLayer(d_model={h}, nhead={cfg_model.num_attention_heads}{groups}, "
             f"dim_feedforward={ffn}, dropout={drop}, activation={activation}, attn_dropout={attn_drop}, "
             f"act_dropout=0.0)")
    norm_name = getattr(cfg_model, "normalization", "LayerNorm")
    norm = f"{norm_name}(normalized_shape=[{h}], epsilon={cfg_model.layernorm_epsilon})"
    untied = getattr(cfg_model, "untie_embeddings_and_output_weights", False)
    head = "LMHeadPipe(output_layer)" if untied else "LMHeadPipe(tied to EmbeddingPipe.word_embeddings)"
    return [embedding] + [layer] * cfg_model.num_layers + [norm, head]


def stage_chunks(config, pp_rank: int, pp_size: int) -> list[tuple[range, bool, bool]]:
    """(global layer indices, holds the embedding, holds the head) of each model chunk pipeline rank ``pp_rank``
    of ``pp_size`` holds: the whole model without pipelining; its stage (``pipeline_partition``); or, under the
    interleaved schedule, its ``virtual_pp_degree`` chunks (``layer_split.rank_chunks``; a layout string's
    chunks may differ in size and hold no decoder layer)."""
    from megatron.config.layer_split import rank_chunks

    d = config.distributed
    return rank_chunks(config.model.num_layers, pp_size, d.virtual_pp_degree, d.pipeline_partition, pp_rank)


def cut_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """The recipe's pipeline step: the whole GPT (built on the meta device) cut, in place, to one model chunk:
    the decoder layers ``layers`` (keyed by their global index, so names are the whole model's), the embedding
    on the first stage, the final norm, head and multi-token prediction on the last. A later stage that holds
    the head of a tied embedding keeps its own copy of the word embedding (named like the first stage's, so it
    is initialised alike; ``tied_copy``: counted once in the gradient norm and checkpoints), one that holds
    multi-token prediction the whole embedding; their gradients are summed with the first stage's
    (``shared_embedding``, marked by the model). Returns ``model``."""
    for key in [key for key in model.layers if int(key) not in layers]:
        del model.layers[key]
    model.pre_process, model.post_process = first, last
    holds_mtp = last and getattr(model, "mtp", None) is not None
    if not first and holds_mtp:
        for param in model.embedding.parameters():
            param.tied_copy = True
    elif not first and last and not model.untied:
        model.embedding.position_embeddings = None  # the head reads the word embedding only
        model.embedding.word_embeddings.weight.tied_copy = True
    elif not first:
        del model.embedding
    if not last:
        for name in ("final_layernorm", "output_layer"):
            if hasattr(model, name):
                delattr(model, name)
        model.mtp = None
    return model
