"""01 - Fully sharded data parallelism (FSDP2): stop replicating the model on every GPU.

The memory problem. Training Llama-3-8B (8.03B parameters) with AdamW in mixed precision keeps,
per parameter, an fp32 master copy (4 bytes), an fp32 gradient (4) and two fp32 Adam moments (8):
16 bytes x 8.03e9 = 128.5 GB = 119.7 GiB on every GPU. An 80 GiB H100 cannot even place it.

The idea. Every rank keeps only 1/N of each of those tensors (a shard of dim 0). Before a block
runs, its full bf16 parameters are all-gathered, used, and freed again; after its backward, the
gradients are reduce-scattered so each rank receives the summed gradient of its own shard, and
the optimizer updates only that shard. Model state per GPU: 119.7 GiB / 8 = 15.0 GiB, plus the
gathered bf16 parameters of the blocks in use (one, the next one prefetched, and the last block
and the root's embeddings and lm_head, kept gathered from forward to backward).

We use PyTorch's own engine, `fully_shard` (FSDP2): one call per transformer block (the unit of
gather and free), then one on the root for the embeddings, final norm and lm_head. The model is
sharded on the meta device, before any rank allocates its shard (support/build.py).

Past 5M tokens: the model state on the host (`--offload-model-state`). Near the longest length
activations fill what the model state leaves, so 15 GiB per GPU on 8 GPUs (60 GiB on 2) is worth
moving. FSDP2's `CPUOffloadPolicy` keeps each rank's shards of the fp32 parameters, gradients and
Adam moments in host memory, and the optimizer steps there; the GPU keeps only the gathered bf16
blocks. The price, per rank: 16 bytes per parameter / GPUs of host memory (Llama-3-8B on 8 GPUs:
15.0 GiB, 15.7 as the pinned allocator rounds parameter and gradient shards up to powers of two),
next to 03's offloaded checkpoints; and per step each block's fp32 shard copied to the GPU twice
(forward and backward, 8 bytes per parameter / GPUs) and each gradient shard back (4): ~12 GB for
Llama-3-8B on 8 GPUs, small beside a step of minutes at millions of tokens.

Run the demo (CPU or GPUs; it allocates nothing model-sized, the 8B model is built on the meta
device and sharded there):

    torchrun --nproc-per-node 2 01_fsdp.py --model llama3-8b
    python 01_fsdp.py --model llama3-8b --world-size 8     # the arithmetic alone, one process
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from base.gradient_memory import gradients_in_compute_memory
from base.one_rank_gather import cast_into_buffer
from model import Transformer

GiB = 2**30


# The technique: shard each block (the unit of gather and free), then the root.

def apply_fsdp(model: torch.nn.Module, mesh, compute_dtype: torch.dtype = torch.float32,
               offload_model_state: bool = False):
    """Shard `model` over `mesh`: each block first, then the root (torchtitan's order).

    compute_dtype=bfloat16 gathers bf16 copies for compute while master weights, gradients and
    the reduce-scatter stay fp32 (more exact, and the optimizer sees fp32 gradients).
    offload_model_state=True: the shards live in (pinned) host memory; FSDP2 copies a group's
    shard to the GPU for its all-gather and each gradient shard back after its reduce-scatter.
    """
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.float32,
    )
    # Pinned memory needs a GPU driver; without one the "offload" is to the CPU it already uses.
    on_host = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
               } if offload_model_state else {}
    for block in model.layers:
        # The last block is needed first by backward: keep it gathered after forward.
        reshard = block is not model.layers[-1]
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, **on_host)
    # The root (embeddings, lm_head) runs last in forward and first in backward: kept gathered too.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False, **on_host)
    ranks = mesh.size() if mesh is not None else dist.get_world_size()
    for module in model.modules():
        if isinstance(module, FSDPModule) and not offload_model_state:
            # FSDP2 reduce-scatters on a stream of its own; left to it, the gradients' memory
            # stays cached for that stream, where the next forward cannot reuse it (near the
            # GPU's capacity: allocator retries, base/gradient_memory.py). On one rank the
            # reduce-scatter is the identity: its output is its input, nothing is copied.
            gradients_in_compute_memory(module, one_rank=ranks == 1)
            if ranks == 1:  # one rank gathers nothing, yet FSDP2 casts each weight, then copies
                # the cast into its buffer: here the cast writes the buffer
                cast_into_buffer(module)
        if isinstance(module, FSDPModule) and ranks > 1:
            # Our loss is already the mean over the tokens of all ranks (train.py divides the
            # summed loss by the global token count), so the rank gradients must be summed,
            # not averaged: FSDP's default average would shrink them by the world size. One
            # rank has nothing to sum, and a factor there makes FSDP2 divide a copy of each
            # group's fp32 gradients (a temporary as large as them: 3.9 GiB at the root of
            # Llama-3-8B on one GPU).
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                # A plain SUM collective (gloo has no PREMUL_SUM, which a factor of 1 would use).
                module.set_force_sum_reduction_for_comms(True)
    return model


# ---- below: the demo -----------------------------------------------------------------------------

# Demo: per-rank bytes with and without sharding.

def sharded_numel_on_meta(args, mesh) -> int:
    """Shard the real model on the meta device and count this rank's parameter elements."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, mesh)
    return sum(p.to_local().numel() for p in model.parameters())


def main():
    from model import get_model_args, num_params
    from support.byte_counts import model_state_bytes, offloaded_model_state_bytes
    from support.demos import end_ranks, start_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to compute for (default: this run's world size)")
    opts = parser.parse_args()
    args = get_model_args(opts.model)

    ranks = start_ranks()
    launched, rank = ranks.launched, ranks.rank
    world = opts.world_size or (ranks.world if launched else 8)

    full, sharded = model_state_bytes(args, 1), model_state_bytes(args, world)
    host = offloaded_model_state_bytes(args, world)
    if rank == 0:
        print(f"{opts.model}: {num_params(args) / 1e9:.2f}B parameters; AdamW, fp32 master "
              f"weights, bf16 compute")
        print(f"{'per rank (GiB)':<16}{'replicated':>12}{f'FSDP x{world}':>12}"
              f"{'+ offload: GPU':>16}{'host':>15}")
        for state in (full, sharded, host):
            state["total"] = sum(state.values())
        for key in full:
            print(f"{key:<16}{full[key] / GiB:>12.1f}{sharded[key] / GiB:>12.1f}{0:>16.1f}"
                  f"{host[key] / GiB:>15.1f}")
        # (host: parameters and gradients pinned, as the pinned allocator rounds them up; the
        # Adam moments in ordinary host memory.) What the host side costs per step: each
        # block's fp32 shard comes to the GPU in forward and again in backward, each gradient
        # shard goes back.
        shard = -(-num_params(args) // world)
        print(f"--offload-model-state: the GPU keeps none of it (only the gathered bf16 "
              f"blocks). Costs per rank: {host['total'] / GiB:.1f} GiB of host memory, "
              f"next to 03's offloaded checkpoints; per step {8 * shard / 1e9:.1f} GB to the GPU "
              f"and {4 * shard / 1e9:.1f} GB back, and AdamW on the host's cores")

    if launched:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ranks.device.type, (dist.get_world_size(),))
        local = sharded_numel_on_meta(args, mesh)
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, local)
        if rank == 0:
            print(f"fully_shard on the meta device, this run's {dist.get_world_size()} ranks hold "
                  f"{', '.join(f'{c / 1e9:.3f}B' for c in counts)} parameters each "
                  f"(= {16 * max(counts) / GiB:.1f} GiB of fp32 state + Adam per rank)")
    end_ranks()


if __name__ == "__main__":
    main()
