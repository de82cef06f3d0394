"""host_buffers.py - reusable host memory for tensors that wait off the GPU (03's and 07's
offloaders).

A block input offloaded by 03 waits in host memory between forward and backward, and the GPU
copies it there and back at full speed only from pinned (page-locked) memory. Two facts shape
the buffers:
  - CUDA's pinned allocator rounds every request up to a power of two: one 3 GiB buffer takes
    4 GiB. So each buffer is made of power-of-two pieces (its size's binary digits), 2 GiB + 1 GiB,
    which take exactly 3 (`power_of_two_pieces`; plan.py counts the host bytes the same way).
  - Pinning is slow and every step offloads the same shapes, so buffers are allocated once and
    reused: `HostBufferPool` keeps the free ones under a key (03: the layer; 07: the layer and
    the saved tensor's index) for the next step.
"""

import torch

MiB = 2**20


def power_of_two_pieces(nbytes: int, smallest: int = 2 * MiB) -> list[int]:
    """`nbytes` as a sum of powers of two, largest first (its binary digits), with what is left
    below `smallest` rounded up to a power of two: pieces CUDA's pinned allocator, which rounds
    every request up to a power of two, reserves without waste (3 GiB -> 2 GiB + 1 GiB)."""
    pieces = []
    while nbytes >= smallest:
        pieces.append(1 << (nbytes.bit_length() - 1))
        nbytes -= pieces[-1]
    if nbytes:
        pieces.append(1 << (nbytes - 1).bit_length())
    return pieces


class HostBuffer:
    """One tensor's place in host memory, in power-of-two pieces (pinned on a GPU machine),
    filled and emptied with one copy per piece."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, pinned: bool):
        self.shape, self.dtype = torch.Size(shape), dtype
        self.nbytes = self.shape.numel() * dtype.itemsize
        self.pieces = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
                       for n in power_of_two_pieces(self.nbytes)]

    def holds(self, like: torch.Tensor) -> bool:
        return self.shape == like.shape and self.dtype == like.dtype

    def parts(self, t: torch.Tensor):
        """(piece, the bytes of contiguous t it holds) pairs."""
        flat = t.view(-1).view(torch.uint8)
        start = 0
        for piece in self.pieces:
            n = min(piece.numel(), self.nbytes - start)
            yield piece[:n], flat[start:start + n]
            start += n

    def copy_from(self, t: torch.Tensor, non_blocking: bool = False) -> None:
        for piece, part in self.parts(t):
            piece.copy_(part, non_blocking=non_blocking)

    def copy_into(self, t: torch.Tensor, non_blocking: bool = False) -> None:
        for piece, part in self.parts(t):
            part.copy_(piece, non_blocking=non_blocking)


class HostBufferPool:
    """Host buffers by key, allocated on first use and handed back for the next step.

    `free`: key -> buffers not in use; `nbytes`: all buffers allocated, in use or free;
    `allocations`: how many times a buffer was allocated (constant across steps once warm)."""

    def __init__(self):
        self.free = {}
        self.nbytes = 0
        self.allocations = 0

    def take(self, key, like: torch.Tensor) -> HostBuffer:
        """A free buffer of `key` that holds a tensor like `like`, or a new one."""
        free = self.free.setdefault(key, [])
        while free:
            buffer = free.pop()
            if buffer.holds(like):
                return buffer
            self.nbytes -= buffer.nbytes  # new length: let it go
        # Pinned (page-locked) memory: the GPU copies it directly, at full speed and without
        # blocking the host; pageable memory would be staged and ~4x slower.
        buffer = HostBuffer(like.shape, like.dtype, pinned=like.is_cuda)
        self.allocations += 1
        self.nbytes += buffer.nbytes
        return buffer

    def give_back(self, key, buffer: HostBuffer) -> None:
        self.free.setdefault(key, []).append(buffer)
