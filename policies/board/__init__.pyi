from .anchors import anchor_payload
from .publish import Board
from .read import BoardReader
from .sharded import ShardedPublisher
from .store import redact
from .types import (
    BASE_FILES,
    MANIFEST,
    WEIGHTS,
    BoardOptions,
    CatchUp,
    Manifest,
    PatchRef,
    Step,
    TensorEntry,
)

__all__ = [
    "BASE_FILES",
    "MANIFEST",
    "WEIGHTS",
    "Board",
    "BoardOptions",
    "BoardReader",
    "CatchUp",
    "Manifest",
    "PatchRef",
    "ShardedPublisher",
    "Step",
    "TensorEntry",
    "anchor_payload",
    "redact",
]
