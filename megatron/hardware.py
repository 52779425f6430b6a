"""Published peaks of known GPUs, in the standard library only (the layout planner reads them without torch).

``PEAK_TFLOPS_16BIT``: the dense bf16/fp16 tensor-core peak of one device in TFLOP/s (no sparsity), the
denominator of MFU unless ``peak_tflops`` is configured (``megatron.device.peak_tflops`` looks the running
device up by its name; ``tools/plan_layout.py --gpu`` by the table's key).
"""

from __future__ import annotations

PEAK_TFLOPS_16BIT = {
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0, "H800": 989.0,
    "L40S": 362.0, "A10": 125.0, "L4": 121.0, "V100": 125.0, "B200": 2250.0,
}


def named_peak_tflops(device_name: str) -> float | None:
    """The table's peak for a device whose name contains a key ("NVIDIA H100 80GB HBM3": 989); None if none does.
    Keys are tried in the table's order, so "A100" is found before "A10"."""
    for key, value in PEAK_TFLOPS_16BIT.items():
        if key in device_name:
            return value
    return None
