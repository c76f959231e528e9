from .connections import LaneLimits
from .decode import DecodeBatcher
from .engine import Engine
from .reference_server import serve_board, serve_model
from .server import LaneServer, run_lane
from .sidecar import Sidecar

__all__ = [
    "DecodeBatcher",
    "Engine",
    "LaneLimits",
    "LaneServer",
    "Sidecar",
    "run_lane",
    "serve_board",
    "serve_model",
]
