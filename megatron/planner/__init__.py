"""The layout planner (tools/plan_layout.py): every valid parallel layout of a model on N devices, its memory
by the checked estimator (``search``) and an estimated step time (``time_model``), every term kept."""

from megatron.planner.search import (
    Layout,
    MemoryTerms,
    Plan,
    PlanResult,
    candidate_layouts,
    configured_layout,
    evaluate_layout,
    layout_config,
    layout_memory,
    non_dominated,
    plan_layouts,
    rank_key,
    recompute_options,
    walked_micro_batches,
)
from megatron.planner.stages import representative_stages, stage_chunks
from megatron.planner.time_model import GB, GIB, Hardware, TimeTerms, gpu_peak_tflops, layout_time

__all__ = ["GB", "GIB", "Hardware", "Layout", "MemoryTerms", "Plan", "PlanResult", "TimeTerms", "candidate_layouts",
           "configured_layout", "evaluate_layout", "gpu_peak_tflops", "layout_config", "layout_memory", "layout_time",
           "non_dominated", "plan_layouts", "rank_key", "recompute_options", "representative_stages", "stage_chunks",
           "walked_micro_batches"]
