"""gradient_memory.py - FSDP2's gradients in the compute stream's memory (01).

FSDP2 reduce-scatters each block's gradients on a CUDA stream of its own (so the next block's
backward overlaps it) and allocates the reduced gradient shards there. PyTorch's caching
allocator keeps a freed block for the stream that allocated it. So once zero_grad frees the
gradients (fp32, 4 bytes per parameter: 29.9 GiB for Llama-3-8B on one GPU), their memory is
cached for the reduce-scatter stream, where the next forward's activations, on the compute
stream, cannot reuse it. A step near the GPU's capacity then runs out of fresh memory in its
forward: the allocator gives every cached block back (synchronizing the GPU) and tries again,
and the backward's gradients do the same on their stream. Measured on one H200: two such
retries a step, ~0.1 s each, for every Llama-3-8B plan (docs/results.md).

`ComputeMemoryReduceScatter` is FSDP2's reduce-scatter with one change: the memory of what it
allocates comes from the compute stream's pool, so the step's gradients and activations share
one pool. It stays safe where a block moves between the streams: the reduce-scatter stream
first waits for the compute stream (whose queued work may still use a block it freed), and
`record_stream` tells the allocator of the block's use on the reduce-scatter stream, so a block
freed while that stream may still read it (a micro-batch's gradients added into the last
ones') is reused only after that. 01 leaves FSDP2's own allocation where the gradients go to
the host (--offload-model-state: they leave the GPU at once). Where the reduce dtype differs
from the parameters' (not 01's: fp32 into fp32 shards) FSDP2's cast would put the gradients
on its stream's memory again.

On one rank a reduce-scatter is the identity, yet FSDP2 still copies its input, the block's
gradients gathered in fp32, into an output of the same size (a pass of 8 bytes per parameter
each step: 64 GB for Llama-3-8B), and holds the input until the next block's reduce-scatter
(0.81 GiB there). `one_rank=True` hands FSDP2 the input's memory as the output as well: its
copy is then a copy onto itself, which PyTorch skips, the gradient shards are views of that
memory, and nothing else is held.
"""

import torch
import torch.distributed as dist

try:  # FSDP2's interface for a custom reduce-scatter (in torch 2.11 and 2.13; a private module)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # older torch: FSDP2 allocates as it does, on its own stream
    ReduceScatter = object


class ComputeMemoryReduceScatter(ReduceScatter):
    """torch.distributed's reduce-scatter, its buffers allocated from the compute stream's pool
    (the default stream, where train.py runs); over one rank, its output is its input."""

    def __init__(self, one_rank: bool = False):
        super().__init__()
        self.one_rank = one_rank
        self.input = None  # one rank: the input FSDP2 asked for, until it asks for the output

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # FSDP2 asks for two buffers per reduce-scatter, its input (on the compute stream) then
        # its output (on its reduce-scatter stream): over one rank the second is the first
        pending, self.input = self.input, None
        output = (pending is not None and pending.shape == torch.Size(size)
                  and pending.dtype == dtype)
        if output and device.type == "cuda":  # asked for on FSDP2's stream, not the compute one
            using = torch.cuda.current_stream(device)
            output = using != torch.cuda.default_stream(device)
            if output:  # the output's stream adds to it (--grad-accum's later micro-batches)
                pending.record_stream(using)
        if output:
            return pending
        buffer = self.new_buffer(size, dtype, device)
        if self.one_rank:
            self.input = buffer
        return buffer

    def new_buffer(self, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return torch.empty(*size, dtype=dtype, device=device)
        using = torch.cuda.current_stream(device)  # FSDP2's reduce-scatter stream, for the output
        compute = torch.cuda.default_stream(device)
        with torch.cuda.stream(compute):
            buffer = torch.empty(*size, dtype=dtype, device=device)
        if using != compute:
            using.wait_stream(compute)  # the block's last user there is done before it is written
            buffer.record_stream(using)  # freed: reused once this stream's work on it is done
        return buffer

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if output_tensor is input_tensor:  # one rank: nothing to reduce, nothing to move
            assert self.one_rank and group.size() == 1, "an in-place reduce-scatter of ranks"
            return None
        # torch 2.13 renamed it (the old name warns there), 2.11 has only the old one; looked up
        # at each call, as FSDP2 does (a wrapper put on torch.distributed, bench/rehearse.py's
        # byte counter, sees the call)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return reduce_scatter(output=output_tensor, input=input_tensor, op=op, group=group,
                              async_op=async_op)


def gradients_in_compute_memory(module, one_rank: bool = False) -> None:
    """Give FSDP module `module` (one fully_shard call's) the reduce-scatter above, where this
    torch has custom reduce-scatters (elsewhere its gradients stay on FSDP2's stream);
    one_rank: it shards over one rank."""
    if ReduceScatter is not object and hasattr(module, "set_custom_reduce_scatter"):
        module.set_custom_reduce_scatter(ComputeMemoryReduceScatter(one_rank))


def gradients_on_the_reduce_scatter_stream(model) -> None:
    """FSDP2's own reduce-scatter for every FSDP module of `model` again (the A/B of bench.step
    and the GPU test's control)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(DefaultReduceScatter())


def one_rank_copies(model) -> None:
    """The compute stream's memory still, but one rank's output a copy of its own again, as
    FSDP2 makes it (bench.step's A/B of the in-place reduce)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # (where 01 left FSDP2's own, it stays)
        if isinstance(module, FSDPModule) and isinstance(reduce_scatter_of(module),
                                                         ComputeMemoryReduceScatter):
            gradients_in_compute_memory(module, one_rank=False)


def one_rank_reduce_of(model) -> str | None:
    """How one rank's reduce-scatter runs, as results record it: "in place" (01's), "copied"
    (FSDP2's own, or one_rank_copies), None without FSDP or over more ranks."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule) or model._get_fsdp_state()._fsdp_param_group is None:
        return None
    if model._get_fsdp_state()._fsdp_param_group.mesh_info.shard_mesh_size != 1:
        return None
    return "in place" if getattr(reduce_scatter_of(model), "one_rank", False) else "copied"


def reduce_scatter_of(module):
    """The reduce-scatter FSDP2 runs for `module`'s gradients (tests)."""
    return module._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm


def gradient_memory_of(model) -> str | None:
    """Where `model`'s FSDP gradients are allocated, as results record it: "compute stream",
    "reduce-scatter stream" (FSDP2's own), or None without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return None
    ours = isinstance(reduce_scatter_of(model), ComputeMemoryReduceScatter)
    return "compute stream" if ours else "reduce-scatter stream"
