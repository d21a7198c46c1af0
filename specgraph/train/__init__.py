"""Draft-head training: data (ShareGPT, self-distilled), the shared loop, per-draft losses."""
from .loop import TrainConfig, train
from .medusa import medusa_loss, new_medusa_for

__all__ = ["TrainConfig", "train", "medusa_loss", "new_medusa_for"]
