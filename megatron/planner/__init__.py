"""The layout planner (tools/plan_layout.py): every valid parallel layout of a model on N devices (``layout``:
one layout, its name and flags; ``filters``: --only / --exclude), its memory on the device and the host
(``memory``, by the checked estimator), an estimated step time (``time_model``), every term kept; ``search``
puts them together."""

from megatron.planner.filters import AxisFilter, accepts, layout_filters, parse_filter
from megatron.planner.layout import AXES, Layout, configured_layout
from megatron.planner.memory import MemoryTerms, layout_memory, walked_micro_batches
from megatron.planner.search import (
    Plan,
    PlanResult,
    candidate_layouts,
    evaluate_layout,
    layout_config,
    non_dominated,
    plan_layouts,
    rank_key,
    recompute_options,
)
from megatron.planner.stages import representative_stages, stage_chunks
from megatron.planner.time_model import GB, GIB, Hardware, TimeTerms, gpu_peak_tflops, layout_time

__all__ = ["AXES", "GB", "GIB", "AxisFilter", "Hardware", "Layout", "MemoryTerms", "Plan", "PlanResult",
           "TimeTerms", "accepts", "candidate_layouts", "configured_layout", "evaluate_layout", "gpu_peak_tflops",
           "layout_config", "layout_filters", "layout_memory", "layout_time", "non_dominated", "parse_filter",
           "plan_layouts", "rank_key", "recompute_options", "representative_stages", "stage_chunks",
           "walked_micro_batches"]
