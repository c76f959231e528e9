from .config import TrainerConfig
from .sft import warm_start
from .trainer import Trainer, TrainSample

__all__ = ["TrainSample", "Trainer", "TrainerConfig", "warm_start"]
