from .config import TrainerConfig
from .samples import TrainSample
from .sft import warm_start
from .trainer import Trainer

__all__ = ["TrainSample", "Trainer", "TrainerConfig", "warm_start"]
