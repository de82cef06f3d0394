"""checkpointed.py - which checkpointed block runs now, and whether it runs for the recompute.

03 runs each block under `checkpoint` twice: its forward, and again in backward (the recompute)
only to rebuild what its ops saved. It sets `running(...)` around both (checkpoint's
context_fn); ops inside a block may ask, and neither lesson imports the other:
  - 04's tiled MLP, the last op of a block, skips its output in the recompute (nothing reads it);
  - --keep-attention (support/keep_attention.py) keeps the block's attention output in the
    forward, moved by the block's offloader with the block input, and takes it back in the
    recompute.
Outside a checkpointed block (no checkpointing, a block that --checkpoint-layers leaves out, or
no gradients) `current_block()` is None.
"""

import contextlib
import contextvars
from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    layer: int
    recomputing: bool  # checkpoint's second run, in backward
    offloader: object  # 03's BlockInputOffloader that moves this block's input, or None


_block = contextvars.ContextVar("checkpointed_block", default=None)


@contextlib.contextmanager
def running(layer: int, recomputing: bool, offloader=None):
    token = _block.set(Block(layer, recomputing, offloader))
    try:
        yield
    finally:
        _block.reset(token)


def current_block() -> Block | None:
    return _block.get()


def is_recomputing() -> bool:
    block = _block.get()
    return block is not None and block.recomputing
