"""The benchmark's peer (bench/ring.py: PyTorch's own context_parallel ring attention on our
model and stack) computes the same loss and gradients as the unsharded model. A throughput
comparison against a peer that computed something else would mean nothing. GPU only: torch's
ring dispatches only CUDA SDPA kernels."""


import pytest
import torch.distributed as dist
from ranks import run_ranks
from reference import assert_step_matches, full, make_batch, reference_loss_and_grads

import train
from bench import ring
from support.config import Config, resolve_techniques
from support.runtime import setup_runtime


def _ring_matches_unsharded(gqa: str, dtype: str):
    cfg = resolve_techniques(Config(
        model="tiny", device="cuda", dtype=dtype, seq_len=256, fsdp=True, checkpoint=True,
        offload=True, tile_mlp=True, tile_loss=True, tile_norm=True, mlp_tile_tokens=48,
        loss_tile_tokens=40))
    tokens, labels = make_batch(256, 1, cfg.seq_len, seed=3, ignore_frac=0.2)
    labels[0, : cfg.seq_len // 4] = -100  # rank 0's first load-balanced chunk: all ignored
    ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels)
    rt = setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    ring.use_ring_attention(model, gqa)
    loss = ring.ring_forward_backward(model, tokens, rt, ring.context_parallel_mesh("cuda"), labels)
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    assert_step_matches(loss.cpu(), grads, ref_loss, ref_grads, "tiny", tokens, labels, dtype,
                        what=f"ring gqa={gqa} {dtype}")
    assert dist.get_world_size() == 2


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", ["native", "repeat"])
def test_ring_peer_nccl_bf16_matches_fp32_reference(gqa):
    run_ranks(2, _ring_matches_unsharded, gqa, "bfloat16", backend="nccl")
