"""Training: one optimizer step (``step.py``) and the Trainer that repeats it (``trainer.py``) with its
collaborators, one job each. ``megatron/pretrain.py`` builds the run and hands it to the Trainer."""

from megatron.training.step import (
    DatasetsProvider,
    ModelProvider,
    TrainState,
    data_loader,
    evaluate,
    set_seed,
    train_step,
)
from megatron.training.trainer import Trainer

__all__ = ["DatasetsProvider", "ModelProvider", "TrainState", "Trainer", "data_loader", "evaluate",
           "set_seed", "train_step"]
