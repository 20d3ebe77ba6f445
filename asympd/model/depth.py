"""How deep a chunk of rows goes in the stack (K = the last KV source layer).

Apart from ``transformer.py`` (which re-exports it) so that the scheduler, the modes and the planner
name a depth without importing torch.
"""

from __future__ import annotations

from enum import IntEnum


class Depth(IntEnum):
    ENCODER_KV = 0  # layers below K, then K's KV path only
    THROUGH_SOURCE = 1  # layers up to and including K
    ALL = 2  # every layer and the head
