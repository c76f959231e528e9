"""Training: the reference trainer and its config.

Public surface (lazily imported, so ``policies.train.config`` stays torch-free):
:class:`Trainer`, :class:`TrainSample`, :class:`TrainerConfig`.

Modules: :mod:`~policies.train.config` (the ``[trainer]`` config tree),
:mod:`~policies.train.trainer` (GRPO steps with a staleness correction, publishing every
version), :mod:`~policies.train.samples` (episodes as samples, a batch as tensors),
:mod:`~policies.train.objective` (a micro-batch's loss and a step's metrics),
:mod:`~policies.train.checkpoint` (the trainer's checkpoint file),
:mod:`~policies.train.scoring` (log probs as the engine sampled them, chunked over tokens). The
SFT warm start of the demo's models is :mod:`orchestrator.warm_start`.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
