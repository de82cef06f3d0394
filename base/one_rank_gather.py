"""one_rank_gather.py - FSDP2's gather on one rank as one cast (01).

Before a block runs, FSDP2 makes its bf16 weights from the fp32 shards: over several ranks a
cast into the all-gather's input, then the collective. Over one rank it skips the collective
but still makes them in two passes (torch 2.11 and 2.13, `wait_for_unshard` for a world of
one): each fp32 shard is cast into a new bf16 tensor, which is then copied into the buffer the
weights live in. The copy reads and writes 4 more bytes a parameter, at every gather: the
forward's, and the backward's again for each block resharded after its forward. For Llama-3-8B
on one GPU that is ~60 GB a step (32 ms of a 16K step's device time on one H200 were these
copies, docs/results.md), a kernel more per weight, and a temporary as large as the largest.

`cast_into_buffer(module)` makes the cast write the buffer itself. FSDP2's copy is then a copy
of a tensor onto itself, which PyTorch skips. The weights are the same cast's, bit for bit.
"""

import torch

try:  # FSDP2's parameter (in torch 2.11 and 2.13; a private module)
    from torch.distributed.fsdp._fully_shard._fsdp_param import (FSDPParam, ShardedState,
                                                                 alloc_storage)
except ImportError:  # another torch: FSDP2's own gather stays
    FSDPParam = None


if FSDPParam is not None:
    class CastIntoBuffer(FSDPParam):
        """FSDP2's parameter whose gather input, on one rank, is the gather's output buffer
        itself, its fp32 shard cast straight into it."""

        @property
        def all_gather_inputs(self) -> list:
            shard = self._sharded_param_data
            if (self.sharded_state != ShardedState.SHARDED or self.offload_to_cpu
                    or hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")):
                return super().all_gather_inputs  # FSDP2's own: on the host, or extended
            dtype = self.param_dtype or shard.dtype
            self.init_all_gather_outputs([shard.numel()], [dtype], 1, shard.device)
            buffer = self.all_gather_outputs[0]
            alloc_storage(buffer)  # (FSDP2 frees its memory after the block's forward)
            # the block's weights are views of the buffer, saved for backward: writing it is
            # the gather, not a change autograd should see (FSDP2's own copy does the same)
            with torch.autograd._unsafe_preserve_version_counter(buffer):
                buffer.copy_(shard)
            return [buffer]


def cast_into_buffer(module) -> None:
    """On one rank, FSDP module `module` (one fully_shard call's) gathers each weight with one
    cast (where this torch's FSDP2 is the one described above)."""
    group = module._get_fsdp_state()._fsdp_param_group
    if FSDPParam is None or group is None:
        return
    assert group.mesh_info.shard_mesh_size == 1, "one rank's gather, over several ranks"
    for fsdp_param in group.fsdp_params:
        if type(fsdp_param) is FSDPParam:
            fsdp_param.__class__ = CastIntoBuffer


def cast_then_copy(model) -> None:
    """FSDP2's own one-rank gather again, a cast then a copy (bench.step's A/B)."""
    for group in param_groups(model):
        for fsdp_param in group.fsdp_params:
            if type(fsdp_param) is not FSDPParam:
                fsdp_param.__class__ = FSDPParam


def one_rank_gather_of(model) -> str | None:
    """How one rank's gather runs, as results record it: "cast into the buffer" (01's), "cast
    then copied" (FSDP2's own), None without FSDP or over more ranks."""
    groups = param_groups(model)
    if not groups or groups[0].mesh_info.shard_mesh_size != 1:
        return None
    cast = all(type(p) is not FSDPParam for group in groups for p in group.fsdp_params)
    return "cast into the buffer" if cast else "cast then copied"


def param_groups(model) -> list:
    """The FSDP2 parameter groups of `model`'s FSDP modules (one per fully_shard call)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [module._get_fsdp_state()._fsdp_param_group for module in model.modules()
              if isinstance(module, FSDPModule)]
    return [group for group in groups if group is not None]
