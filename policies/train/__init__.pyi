from .config import TrainerConfig
from .samples import TrainSample
from .trainer import Trainer

__all__ = ["TrainSample", "Trainer", "TrainerConfig"]
