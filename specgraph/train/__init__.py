"""Draft-head training: data (ShareGPT, self-distilled), the shared loop, per-draft losses."""
from .loop import TrainConfig, train
from .eagle3 import eagle3_loss, new_eagle3_for
from .medusa import medusa_loss, new_medusa_for

__all__ = ["TrainConfig", "train", "eagle3_loss", "new_eagle3_for", "medusa_loss", "new_medusa_for"]
