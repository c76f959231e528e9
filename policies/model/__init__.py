"""sprawl's own tiny *real* model: tokenizer, chat template and weights, built offline.

Public surface (lazily imported): :func:`init_model`, :func:`build_tokenizer`, ``ModelSize``.
Modules: :mod:`~policies.model.build` (tokenizer + ``Qwen2ForCausalLM``, written to a model
directory), :mod:`~policies.model.tokenizer` (the byte-level BPE and the tokens a chat template
needs), :mod:`~policies.model.sizes` (each size's shape), :mod:`~policies.model.chat_template`
(what any chat template needs from its tokenizer, and the model directory's ``sprawl.json``
notes), :mod:`~policies.model.corpus` (the generated text the tokenizer is trained on) and
:mod:`~policies.model.moe` (MoE routing, recorded and replayed).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
