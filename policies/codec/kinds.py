"""The kinds of tensor checksum a served view is recorded with (no torch: the board's types
name them).

:data:`SUM` is what every view is published with (:mod:`policies.codec.digests`); :data:`XXH3`
is what views published before it carry (board manifest formats 2–4, patch format 1), still
read and verified.
"""

from typing import Literal

Kind = Literal["sum-128", "xxh3-128"]
SUM: Kind = "sum-128"
XXH3: Kind = "xxh3-128"
