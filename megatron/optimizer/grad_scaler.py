"""Loss scaling for fp16: a constant scale, or a dynamic one that backs off on overflow.

Dynamic rule (Megatron-LM's): on a step whose gradients hold inf/nan the step is skipped and
the hysteresis counter drops; when it reaches zero the scale is multiplied by
``backoff_factor`` (never below ``min_scale``). After ``growth_interval`` clean steps in a
row the scale is multiplied by ``growth_factor`` and the hysteresis is restored.
"""

from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    def __init__(self, initial_scale: float, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._hysteresis_left = hysteresis
        self._clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._clean_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
