"""Per-rank memory of one pipeline stage: model states + saved activations + the largest temporary.

``estimate(config, stage)`` adds:

- ``model_states``: what the rank holds on the device between steps (``megatron/memory/model_states.py``:
  parameters, fp32 gradients, masters, AdamW states, by the sharding stage in effect; a MoE model's experts
  those of its expert-parallel rank, sharded over the expert-data-parallel ranks; offloaded states
  excluded) plus what exists only during a step (``step_transient_bytes``: stage 2's full gradient
  buffer, stage 3's gathered parameters and gradients);
- ``activations``: the bytes the micro-batches in flight on this stage have saved for the backward,
  at the schedule's peak (``activations.peak_activation_bytes``), less what activation offloading keeps in host
  memory instead (``memory.offload.freed_bytes``; those bytes join ``cpu``);
- ``temporaries``: the largest transient buffer (``activations.largest_temporary_bytes``; with expert
  parallelism the token dispatch's buffers among them, ``megatron.memory.moe``).

``total`` is their sum: a lower bound of the device's peak (no allocator slack, no CUDA context, no
activation gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.schema import Config
from megatron.memory import activations as act
from megatron.memory.model_states import rank_model_state_bytes, step_transient_bytes
from megatron.memory.offload import freed_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device of pipeline ``stage``."""

    stage: int
    model_states: int  # on the device during a step (between steps + step_transient)
    activations: int  # saved activations of the micro-batches in flight, at the peak
    temporaries: int  # the largest transient buffer
    total: int
    activations_per_microbatch: int = 0  # one micro-batch's forward, all chunks of the stage
    in_flight: tuple[int, ...] = ()  # micro-batches held per chunk at the peak
    model_states_between_steps: int = 0
    cpu: int = 0  # offloaded masters, AdamW states and gradient copy; offloaded activations (host memory)
    offloaded_per_microbatch: int = 0  # activations one micro-batch sends to host, all chunks (megatron.offload)


def estimate(config: Config, stage: int = 0, kernel: str | None = None) -> MemoryEstimate:
    """The memory of ``stage`` for a validated ``config`` (``kernel``: see ``activations.dims``)."""
    states = rank_model_state_bytes(config, stage)
    model_states = states.device_total + step_transient_bytes(config, stage)
    chunks = range(len(act.chunk_specs(config, stage)))
    offloaded = [freed_bytes(config, stage, c, kernel) for c in chunks]
    per_chunk = [act.activation_bytes_per_microbatch(config, stage, c, kernel) - off
                 for c, off in zip(chunks, offloaded)]
    in_flight = act.in_flight_at_peak(config, stage, per_chunk)
    activations = sum(k * w for k, w in zip(in_flight, per_chunk))
    host = sum(k * w for k, w in zip(in_flight, offloaded))
    temporaries = act.largest_temporary_bytes(config, stage, kernel)
    return MemoryEstimate(stage, model_states, activations, temporaries, model_states + activations + temporaries,
                          sum(per_chunk), in_flight, states.device_total, states.cpu_total + host, sum(offloaded))
