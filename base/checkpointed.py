"""checkpointed.py - which checkpointed block runs now, and whether it runs for the recompute.

03 runs each block under `checkpoint` twice: its forward, and again in backward (the recompute)
only to rebuild what its ops saved. It sets `running(...)` around both (checkpoint's
context_fn); ops inside a block may ask, and neither lesson imports the other: 04's tiled MLP,
the last op of a block, skips its output in the recompute (nothing reads it). Outside a
checkpointed block (no checkpointing, a block that --checkpoint-layers leaves out, or no
gradients) `current_block()` is None.

Keep-attention's seam, `forward_or_kept`: an attention that runs its own forward (05's stages,
06's ring) calls it through here. Plainly it runs the forward; inside a block where
--keep-attention (support/keep_attention.py) installed a keeper (`keeping`), the keeper keeps
the result in the block's forward and hands it back in the recompute instead of running it.
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


_keeper = contextvars.ContextVar("attention_keeper", default=None)


def forward_or_kept(forward, *args, **kwargs):
    """forward(*args, **kwargs) -> (out, *log-sum-exps), or what this block's keeper makes of
    it (kept in the forward, taken back in the recompute)."""
    keeper = _keeper.get()
    return forward(*args, **kwargs) if keeper is None else keeper(forward, *args, **kwargs)


@contextlib.contextmanager
def keeping(keeper):
    """Within: `forward_or_kept` calls keeper(forward, *args, **kwargs)."""
    token = _keeper.set(keeper)
    try:
        yield
    finally:
        _keeper.reset(token)
