from .build import ModelSize, build_tokenizer, init_model

__all__ = ["ModelSize", "build_tokenizer", "init_model"]
