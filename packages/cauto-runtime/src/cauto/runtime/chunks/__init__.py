"""Chunk-based heterogeneous memory for model state (PatrickStar-style), with ZeRO data parallelism.

Entry point: :func:`wrap`. See ``manager.py`` for the placement policy.
"""

from cauto.plan.chunking import search_chunk_elems
from cauto.plan.units import parse_bytes

from .arena import Arena, BudgetError, TrafficCounter
from .chunk import Layout, ParamSlot, TensorState, build_layout, chunk_state
from .manager import ChunkManager
from .model import ChunkedModel
from .optim import ChunkedAdam
from .wrap import chunk_module, load_checkpoint, save_checkpoint, wrap

__all__ = ["Arena", "BudgetError", "ChunkManager", "ChunkedAdam", "ChunkedModel", "Layout", "ParamSlot",
           "TensorState", "TrafficCounter", "build_layout", "chunk_module", "chunk_state", "load_checkpoint", "parse_bytes",
           "save_checkpoint", "search_chunk_elems", "wrap"]
