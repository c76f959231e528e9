from .apply import apply_patch
from .digests import checksums, state_digest, tensor_checksum
from .encode import encode_patch, squash
from .format import CODEC, PatchHeader, TensorRecord, read_patch_header

__all__ = [
    "CODEC",
    "PatchHeader",
    "TensorRecord",
    "apply_patch",
    "checksums",
    "encode_patch",
    "read_patch_header",
    "squash",
    "state_digest",
    "tensor_checksum",
]
