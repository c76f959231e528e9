from .build import init_model
from .sizes import ModelSize
from .tokenizer import build_tokenizer

__all__ = ["ModelSize", "build_tokenizer", "init_model"]
