"""01 - Fully sharded data parallelism (FSDP2): stop replicating the model on every GPU.

The memory problem. Training Llama-3-8B (8.03B parameters) with AdamW in mixed precision keeps,
per parameter, an fp32 master copy (4 bytes), an fp32 gradient (4) and two fp32 Adam moments (8):
16 bytes x 8.03e9 = 128.5 GB = 119.7 GiB on every GPU. An 80 GiB H100 cannot even place it.

The idea. Every rank keeps only 1/N of each of those tensors (a shard of dim 0). Before a block
runs, its full bf16 parameters are all-gathered, used, and freed again; after its backward, the
gradients are reduce-scattered so each rank receives the summed gradient of its own shard, and
the optimizer updates only that shard. Model state per GPU: 119.7 GiB / 8 = 15.0 GiB, plus one
block's gathered bf16 parameters at a time.

We use PyTorch's own engine, `fully_shard` (FSDP2): one call per transformer block (the unit of
gather and free), then one on the root for the embeddings, final norm and lm_head.

Run the demo (CPU or GPUs; it allocates nothing model-sized, the 8B model is built on the meta
device and sharded there):

    torchrun --nproc-per-node 2 01_fsdp.py --model llama3-8b
    python 01_fsdp.py --model llama3-8b --world-size 8     # the arithmetic alone, one process
"""

import argparse
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from model import Transformer, get_model_args, num_params

GiB = 2**30


# ---------------------------------------------------------------------------------------------
# What this file removes, in bytes (the planner in train.py adds these up).
# ---------------------------------------------------------------------------------------------

def model_state_bytes(args, world_size: int) -> dict:
    """Per-rank bytes of model state with AdamW in mixed precision, sharded over `world_size`.

    fp32 parameters, fp32 gradients and two fp32 Adam moments are sharded; the bf16 copy of one
    block gathered for compute (and its gradient before reduce-scatter) is not, but is small.
    """
    n = num_params(args)
    per_rank = -(-n // world_size)  # ceil: FSDP pads the last shard
    return {"parameters": 4 * per_rank, "gradients": 4 * per_rank, "optimizer": 8 * per_rank}


def fsdp_buffer_bytes(args, bytes_per_value: int = 2) -> dict:
    """Per-rank bytes of the unsharded copies FSDP2 makes, in the compute dtype, at three moments
    of a step. The "root" holds the embeddings, the final norm and lm_head; apply_fsdp keeps it
    (and the last block) gathered from forward to backward.

      after_forward:   the root's and the last block's gathered parameters;
      during_backward: the root's, two blocks' (the one in backward and the next, prefetched;
                       one in a one-layer model),
                       the running block's unsharded gradients, and lm_head's unsharded gradient
                       (the root's gradients are reduce-scattered only when backward ends);
      end_of_backward: the root's unsharded gradients and their fp32 copy for the reduce-scatter
                       (the root's parameters are already resharded by then).

    For Llama-3-8B in bf16: root 1.96 GiB, one block 0.41 GiB; on any number of GPUs.
    """
    root = num_params(replace(args, n_layers=0))
    block = (num_params(args) - root) // max(args.n_layers, 1)
    gathered_blocks = min(args.n_layers, 2)
    return {"after_forward": bytes_per_value * (root + block),
            "during_backward": bytes_per_value * (root + (gathered_blocks + 1) * block
                                                  + args.vocab_size * args.dim),
            "end_of_backward": (bytes_per_value + 4) * root}


# ---------------------------------------------------------------------------------------------
# The technique
# ---------------------------------------------------------------------------------------------

def apply_fsdp(model: torch.nn.Module, mesh, compute_dtype: torch.dtype = torch.float32):
    """Shard `model` over `mesh`: each block first, then the root (torchtitan's order).

    compute_dtype=bfloat16 gathers bf16 copies for compute while master weights, gradients and
    the reduce-scatter stay fp32 (more exact, and the optimizer sees fp32 gradients).
    """
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.float32,
    )
    for block in model.layers:
        # The last block is needed first by backward: keep it gathered after forward.
        reshard = block is not model.layers[-1]
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Our loss is already the mean over the tokens of all ranks (train.py divides the
            # summed loss by the global token count), so the rank gradients must be summed,
            # not averaged: FSDP's default average would shrink them by the world size.
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                # A plain SUM collective (gloo has no PREMUL_SUM, which a factor of 1 would use).
                module.set_force_sum_reduction_for_comms(True)
    return model


def build_model(args, device: torch.device, mesh=None, compute_dtype=torch.float32,
                seed: int = 0, exact_init: bool = True, before_sharding=None):
    """Build, optionally transform, shard and initialize a model.

    The model is created on the meta device (no memory), `before_sharding(model)` applies the
    seam-level techniques (02-05), FSDP shards it, and only then is each rank's shard allocated
    and initialized: an 8B model never exists whole in one process.
    """
    with torch.device("meta"):
        model = Transformer(args)
    if before_sharding is not None:
        before_sharding(model)
    if mesh is not None:
        apply_fsdp(model, mesh, compute_dtype)
    model.to_empty(device=device)
    from model import init_weights

    init_weights(model, seed, exact=exact_init)
    if mesh is None and compute_dtype != torch.float32:
        model.to(compute_dtype)  # single process, no FSDP: plain low-precision training
    return model


# ---------------------------------------------------------------------------------------------
# Demo: per-rank bytes with and without sharding.
# ---------------------------------------------------------------------------------------------

def sharded_numel_on_meta(args, mesh) -> int:
    """Shard the real model on the meta device and count this rank's parameter elements."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, mesh)
    return sum(p.to_local().numel() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to compute for (default: this run's world size)")
    opts = parser.parse_args()
    args = get_model_args(opts.model)

    from demos import end_ranks, start_ranks

    ranks = start_ranks()
    launched, rank = ranks.launched, ranks.rank
    world = opts.world_size or (ranks.world if launched else 8)

    full, sharded = model_state_bytes(args, 1), model_state_bytes(args, world)
    if rank == 0:
        print(f"{opts.model}: {num_params(args) / 1e9:.2f}B parameters; AdamW, fp32 master "
              f"weights, bf16 compute")
        print(f"{'per rank (GiB)':<16}{'replicated':>12}{f'FSDP x{world}':>12}")
        for key in full:
            print(f"{key:<16}{full[key] / GiB:>12.1f}{sharded[key] / GiB:>12.1f}")
        print(f"{'total':<16}{sum(full.values()) / GiB:>12.1f}{sum(sharded.values()) / GiB:>12.1f}")

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
