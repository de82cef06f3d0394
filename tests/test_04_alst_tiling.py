"""04_alst_tiling.py: tiled MLP and tiled loss equal the untiled ones, and never build the
sequence-wide buffers they exist to avoid."""

import copy
import importlib
import os
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from reference import (assert_matches, assert_within_bf16_error, make_batch,
                       reference_loss_and_grads, techniques_applied, techniques_of,
                       train_loss_and_grads)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import model as llama
from support.demos import LargestTensor
from support import byte_counts
from support.config import Config, resolve_techniques
from support.runtime import setup_runtime

tiling = importlib.import_module("04_alst_tiling")
train = importlib.import_module("train")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small shapes where tokens > dim, so tokens x ffn_dim and tokens x vocab are the largest tensors
# the untiled paths make (larger than any weight or its gradient): the "acts" checks can fail.
ARGS = replace(llama.get_model_args("tiny"), dim=16, ffn_dim=48, vocab_size=64, n_layers=1,
               n_heads=2, n_kv_heads=1)
BATCH, SEQ = 2, 25  # 50 tokens, flattened over batch and sequence
TILE_CASES = [10, 25, 7, 3, 64, None]  # dividing 50, not dividing, larger than 50, default


def _mlp_and_input(seed=0):
    torch.manual_seed(seed)
    mlp = llama.MLP(ARGS)
    x = torch.randn(BATCH, SEQ, ARGS.dim)
    return mlp, x


def _untiled_and_tiled_mlp(tile_tokens):
    mlp, x = _mlp_and_input()
    grad_out = torch.randn(BATCH, SEQ, ARGS.dim)
    results = []
    for run in (lambda x: mlp(x), lambda x: tiling.tiled_mlp_forward(mlp, x, tile_tokens)):
        mlp.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_()
        out = run(x_leaf)
        out.backward(grad_out)
        results.append((out.detach(), x_leaf.grad,
                        {n: p.grad.clone() for n, p in mlp.named_parameters()}))
    return results


@pytest.mark.parametrize("tile_tokens", TILE_CASES)
def test_tiled_mlp_equals_untiled(tile_tokens):
    (out, dx, grads), (tiled_out, tiled_dx, tiled_grads) = _untiled_and_tiled_mlp(tile_tokens)
    torch.testing.assert_close(tiled_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled_dx, dx, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"tile {tile_tokens} grad {name}: {m}")


def _autograd_grads(output, inputs, grad_out):
    """What autograd gives on the plain formula: the inputs' gradients."""
    return torch.autograd.grad(output, inputs, grad_out)


def _with_start(weights):
    """fp32 sums that already hold a value (as after earlier tiles), and those values."""
    starts = [torch.randn(w.shape) for w in weights]
    return [s.clone() for s in starts], starts


def test_swiglu_backward_by_hand_equals_autograd():
    """One tile of 04's SwiGLU backward by hand, against autograd on the plain formula (fp32,
    CPU): the input's gradient, and each weight's gradient added onto its fp32 sum."""
    mlp, x = _mlp_and_input()
    x, grad_out = x[0], torch.randn(SEQ, ARGS.dim)  # one tile of 25 tokens
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    leaves = [t.detach().clone().requires_grad_() for t in (x, *weights)]
    want_x, *want_weights = _autograd_grads(tiling.swiglu(*leaves), leaves, grad_out)
    sums, starts = _with_start(weights)
    got_x = tiling.swiglu_backward(x, grad_out, *(w.detach() for w in weights), sums)
    torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-6)
    for got, start, want in zip(sums, starts, want_weights):
        torch.testing.assert_close(got - start, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ignored", ["some", "all"])
def test_loss_backward_by_hand_equals_autograd(ignored):
    """One tile of 04's norm + lm_head + cross-entropy and its backward by hand, for a loss
    gradient of 1 (the tiled loss runs it in forward), against autograd on the plain formula
    (fp32, CPU): the tile's loss, h's gradient and the two weights' added onto their sums. A
    tile whose labels are all ignored gives exact zeros."""
    model, labels = _loss_model(), _labels()[0]
    if ignored == "all":
        labels = torch.full_like(labels, llama.IGNORE_INDEX)
    h = torch.randn(SEQ, ARGS.dim, generator=torch.Generator().manual_seed(2))
    weights = [model.norm.weight, model.lm_head.weight]
    eps = model.norm.eps
    leaves = [t.detach().clone().requires_grad_() for t in (h, *weights)]
    loss = tiling.norm_lm_head_loss(leaves[0], labels, *leaves[1:], eps=eps)
    want_h, *want_weights = _autograd_grads(loss, leaves, torch.tensor(1.0))
    sums, starts = _with_start(weights)
    got_loss, got_h = tiling.tile_loss_and_backward(h, labels,
                                                    *(w.detach() for w in weights), sums, eps)
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-6)
    for got, start, want in zip(sums, starts, want_weights):
        torch.testing.assert_close(got - start, want, rtol=1e-5, atol=1e-6)
    if ignored == "all":
        assert torch.count_nonzero(got_h) == 0 and all(torch.equal(g, s)
                                                       for g, s in zip(sums, starts))


def test_the_tiled_loss_computes_its_gradients_in_forward_and_nothing_twice():
    """ALST's loss: each tile's lm_head product runs once, in forward, with its two backward
    products; backward runs no matmul (it scales what forward computed), and without a
    backward coming (no_grad) forward runs the products of the loss alone."""
    model, labels = _loss_model(), _labels()
    h = torch.randn(BATCH, SEQ, ARGS.dim).requires_grad_()
    tiles = tiling.tile_count(BATCH * SEQ, 7)
    with OpsSeen() as forward:
        loss = tiling.tiled_loss_sum(model, h, labels, 7)
    with OpsSeen() as backward:
        (loss * 0.37).backward()
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm_.default,
               torch.ops.aten.addmm.default}
    assert sum(op in matmuls for op in forward.ops) == 3 * tiles, forward.ops
    assert not any(op in matmuls for op in backward.ops), backward.ops
    with torch.no_grad(), OpsSeen() as evaluation:
        tiling.tiled_loss_sum(model, h, labels, 7)
    assert sum(op in matmuls for op in evaluation.ops) == tiles, evaluation.ops


def test_rms_norm_backward_by_hand_equals_autograd():
    torch.manual_seed(3)
    x, grad_out = torch.randn(SEQ, ARGS.dim), torch.randn(SEQ, ARGS.dim)
    weight = torch.rand(ARGS.dim) + 0.5
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    want_x, want_weight = _autograd_grads(llama.rms_norm(*leaves, 1e-5), leaves, grad_out)
    (total,), (start,) = _with_start([weight])
    got_x = tiling.rms_norm_backward(x, grad_out, weight, total, 1e-5)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total - start, want_weight, rtol=1e-5, atol=1e-6)


def _loss_model(seed=0):
    torch.manual_seed(seed)
    model = llama.Transformer(ARGS)
    for p in model.norm.parameters():
        p.data.uniform_(0.5, 1.5)  # a norm weight other than ones, so its gradient is tested
    return model


def _labels(ignore_rows=()):
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=generator)
    labels[torch.rand(labels.shape, generator=generator) < 0.3] = llama.IGNORE_INDEX
    labels[0, 3:17] = llama.IGNORE_INDEX  # with tiles of 3, 7 or 10, some tiles are all ignored
    return labels


def _untiled_and_tiled_loss(tile_tokens, labels):
    model = _loss_model()
    h = torch.randn(BATCH, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(2))
    results = []
    for run in (lambda h: llama.Transformer.loss_sum(model, h, labels),
                lambda h: tiling.tiled_loss_sum(model, h, labels, tile_tokens)):
        model.zero_grad(set_to_none=True)
        h_leaf = h.clone().requires_grad_()
        loss = run(h_leaf)
        (loss * 0.37).backward()  # a gradient other than 1 reaches the tiles
        results.append((loss.detach(), h_leaf.grad,
                        {"norm": model.norm.weight.grad.clone(),
                         "lm_head": model.lm_head.weight.grad.clone()}))
    return results


@pytest.mark.parametrize("tile_tokens", TILE_CASES)
def test_tiled_loss_equals_untiled(tile_tokens):
    (loss, dh, grads), (tiled_loss, tiled_dh, tiled_grads) = _untiled_and_tiled_loss(
        tile_tokens, _labels())
    assert tiled_loss.dtype == torch.float32 and torch.isfinite(tiled_loss)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled_dh, dh, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"tile {tile_tokens} grad {name}: {m}")


def test_bf16_tiled_loss_with_the_mean_s_gradient_stays_within_the_bf16_rule():
    """In bf16 the tiles' gradients are computed in forward for a loss gradient of 1 and
    scaled by the real one in backward (train.py's 1 / token count): h's gradient is rounded
    to bf16 twice (as ALST's is), the weights' sums once. Against the fp32 untiled loss, within
    the one bf16 rule of the untiled bf16 run (CPU)."""
    model32 = _loss_model()
    model = copy.deepcopy(model32).to(torch.bfloat16)
    labels = _labels()
    h = torch.randn(BATCH, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(2))
    counted = int((labels != llama.IGNORE_INDEX).sum())
    results = {}
    for name, this, run, inputs in (
            ("reference", model32, llama.Transformer.loss_sum, h),
            ("unsharded", model, llama.Transformer.loss_sum, h.bfloat16()),
            ("tiled", model, partial(tiling.tiled_loss_sum, tile_tokens=7), h.bfloat16())):
        this.zero_grad(set_to_none=True)
        leaf = inputs.clone().requires_grad_()
        loss = run(this, leaf, labels) / counted
        loss.backward()
        results[name] = {"loss": loss.detach().float(), "dh": leaf.grad.float(),
                         "dnorm": this.norm.weight.grad.float(),
                         "dlm_head": this.lm_head.weight.grad.float()}
    assert_within_bf16_error(results["tiled"], results["unsharded"], results["reference"],
                             "tiled loss in bf16, the mean's gradient")


def test_all_ignored_tiles_give_zero_not_nan():
    labels = torch.full((BATCH, SEQ), llama.IGNORE_INDEX)
    (loss, dh, grads), (tiled_loss, tiled_dh, tiled_grads) = _untiled_and_tiled_loss(7, labels)
    assert tiled_loss.item() == 0.0 and loss.item() == 0.0
    assert torch.count_nonzero(tiled_dh) == 0 and torch.isfinite(tiled_dh).all()
    for grad in tiled_grads.values():
        assert torch.count_nonzero(grad) == 0 and torch.isfinite(grad).all()
    # One tile all ignored among others: it adds exactly nothing.
    model = _loss_model()
    h = torch.randn(1, 14, ARGS.dim)
    labels = torch.randint(0, ARGS.vocab_size, (1, 14))
    labels[0, 7:] = llama.IGNORE_INDEX
    assert tiling.tiled_loss_sum(model, h, labels, 7).item() == pytest.approx(
        tiling.tiled_loss_sum(model, h[:, :7], labels[:, :7], 7).item(), rel=0, abs=0)


def test_each_weight_gets_one_gradient_per_backward():
    """Weight gradients are added up inside the Function and handed to autograd once, so FSDP
    sees (and reduce-scatters) one gradient per parameter, not one per tile."""
    mlp, x = _mlp_and_input()
    model = _loss_model()
    labels = _labels()
    arrivals = {}
    for name, p in [*mlp.named_parameters(), *model.named_parameters()]:
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: arrivals.__setitem__(name, arrivals.get(name, 0) + 1))
    h = tiling.tiled_mlp_forward(mlp, x.requires_grad_(), 3)  # 17 tiles
    tiling.tiled_loss_sum(model, h, labels, 4).backward()  # 13 tiles
    expected = {n: 1 for n, _ in mlp.named_parameters()} | {"norm.weight": 1, "lm_head.weight": 1}
    assert arrivals == expected


def test_composes_with_activation_checkpointing():
    """Inside torch.utils.checkpoint (as 03 wraps each block) the tiled forward runs twice (the
    loss's with its gradients, the MLP's backward once); gradients still equal the plain
    model's."""
    mlp, x = _mlp_and_input()
    model, labels = _loss_model(), _labels()
    params = [*mlp.parameters(), model.norm.weight, model.lm_head.weight]

    def tiled(x):
        return tiling.tiled_loss_sum(model, tiling.tiled_mlp_forward(mlp, x, 7), labels, 4)

    results = []
    for run in (lambda x: llama.Transformer.loss_sum(model, mlp(x), labels),
                lambda x: torch.utils.checkpoint.checkpoint(tiled, x, use_reentrant=False)):
        x_leaf = x.clone().requires_grad_()
        loss = run(x_leaf)
        grads = torch.autograd.grad(loss, [x_leaf, *params])
        results.append((loss.detach(), grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _largest(run, x):
    x = x.clone().requires_grad_()
    with LargestTensor() as largest:
        run(x).sum().backward()
    return largest


def test_tiling_acts_loss_never_builds_tokens_x_vocab():
    model, labels = _loss_model(), _labels()
    h = torch.randn(BATCH, SEQ, ARGS.dim)
    tokens_x_vocab = BATCH * SEQ * ARGS.vocab_size
    untiled = _largest(lambda h: llama.Transformer.loss_sum(model, h, labels), h)
    assert untiled.numel >= tokens_x_vocab, "the check cannot fail: the untiled loss never hit it"
    for tile in (7, 25):
        tiled = _largest(lambda h: tiling.tiled_loss_sum(model, h, labels, tile), h)
        assert tiled.numel < tokens_x_vocab, f"tile {tile}: a tensor of shape {tiled.shape} exists"
        assert tiled.numel <= max(tile * ARGS.vocab_size, ARGS.vocab_size * ARGS.dim,
                                  BATCH * SEQ * ARGS.dim)


def test_tiling_acts_mlp_never_builds_tokens_x_ffn():
    mlp, x = _mlp_and_input()
    tokens_x_ffn = BATCH * SEQ * ARGS.ffn_dim
    untiled = _largest(mlp, x)
    assert untiled.numel >= tokens_x_ffn, "the check cannot fail: the untiled MLP never hit it"
    for tile in (7, 25):
        tiled = _largest(lambda x: tiling.tiled_mlp_forward(mlp, x, tile), x)
        assert tiled.numel < tokens_x_ffn, f"tile {tile}: a tensor of shape {tiled.shape} exists"


@pytest.mark.parametrize("tile_tokens", TILE_CASES)
def test_tiled_norm_equals_untiled(tile_tokens):
    torch.manual_seed(1)
    norm = llama.RMSNorm(ARGS.dim, ARGS.norm_eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, grad_out = torch.randn(BATCH, SEQ, ARGS.dim), torch.randn(BATCH, SEQ, ARGS.dim)
    results = []
    for run in (norm, lambda x: tiling.tiled_norm_forward(norm, x, tile_tokens)):
        norm.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = run(leaf)
        out.backward(grad_out)
        results.append((out.detach(), leaf.grad, norm.weight.grad.clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class LargestFp32(TorchDispatchMode):
    """The most elements of any fp32 tensor an op produces (the norm's upcast copies)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


def test_tiling_acts_norm_never_upcasts_the_whole_sequence():
    """In bf16 the norm computes in fp32, on a CPU op by op (F.rms_norm's composite): untiled,
    fp32 copies of all tokens x dim exist (in forward and backward); tiled, only one tile's."""
    norm = llama.RMSNorm(ARGS.dim, ARGS.norm_eps).to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, ARGS.dim, dtype=torch.bfloat16)
    tokens_x_dim = BATCH * SEQ * ARGS.dim
    sizes = {}
    for tile in (None, 7):
        run = (norm if tile is None
               else (lambda x, tile=tile: tiling.tiled_norm_forward(norm, x, tile)))
        leaf = x.clone().requires_grad_()
        with LargestFp32() as largest:
            run(leaf).sum().backward()
        sizes[tile] = largest.numel
    # and apply_tiling really installs it on both norms of a block
    from types import SimpleNamespace

    block = llama.Block(ARGS).to(torch.bfloat16)
    tiling.apply_tiling(SimpleNamespace(layers=[block]), tile_mlp=False, tile_loss=False,
                        tile_norm=True, mlp_tile_tokens=7)
    for name in ("input_layernorm", "post_attention_layernorm"):
        leaf = x.clone().requires_grad_()
        with LargestFp32() as largest:
            getattr(block, name)(leaf).sum().backward()
        sizes[name] = largest.numel
    assert sizes[None] >= tokens_x_dim, "the check cannot fail: the untiled norm never hit it"
    for tiled in (7, "input_layernorm", "post_attention_layernorm"):
        assert sizes[tiled] < tokens_x_dim and sizes[tiled] <= max(7 * ARGS.dim, ARGS.dim), sizes


def test_under_checkpointing_the_mlp_runs_forward_twice_not_three_times(monkeypatch):
    """The tiled MLP's backward recomputes its tiles; 03's block recompute would run them a third
    time for an output nothing reads there, so it skips them (count the tile computations: the
    forward's, and the backward's, which recomputes the forward's intermediates)."""
    checkpointing = importlib.import_module("03_checkpoint_offload")
    calls = []
    for name in ("swiglu", "swiglu_backward"):
        fn = getattr(tiling, name)
        monkeypatch.setattr(tiling, name,
                            lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    model = llama.Transformer(ARGS)
    llama.init_weights(model)
    tiling.apply_tiling(model, tile_mlp=True, tile_loss=False, mlp_tile_tokens=10)
    checkpointing.apply_checkpointing(model)
    ids = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ))
    model(ids, torch.arange(SEQ).expand(BATCH, -1), ids).backward()
    # 50 tokens in 5 tiles: forward once, backward once
    assert calls == ["swiglu"] * 5 + ["swiglu_backward"] * 5


def test_saved_for_backward_is_only_the_input():
    """Between forward and backward the tiled MLP keeps its input and weights, nothing per tile."""
    mlp, x = _mlp_and_input()
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        tiling.tiled_mlp_forward(mlp, x, 7)
    assert sorted(saved) == sorted([x.numel(), *(p.numel() for p in mlp.parameters())])


def test_default_tiles_follow_shapes():
    llama8b = llama.get_model_args("llama3-8b")
    assert tiling.mlp_tile_size(4096, 393_216) == 4096  # 96 tiles of dim tokens, like ALST
    assert tiling.mlp_tile_size(4096, 5000) == 2500  # two equal tiles, not 4096 + 904
    assert tiling.mlp_tile_size(4096, 5000, 1000) == 1000  # set explicitly
    loss_tile = tiling.loss_tile_size(llama8b.vocab_size, 393_216)
    assert loss_tile * llama8b.vocab_size * 4 <= 2**30 < (loss_tile + 2) * llama8b.vocab_size * 4
    assert tiling.tile_count(50, 7) == 8 and tiling.token_tiles(50, 7)[-1] == slice(49, 50)


def test_planner_bytes():
    llama8b = llama.get_model_args("llama3-8b")
    local = 3 * 2**20 // 8  # 3M tokens on 8 GPUs
    # Untiled: the bf16 logits and their bf16 gradient at the cross-entropy's backward
    # (base/fused.py), plus the final norm: fused, its input, output and 1/rms; op by op an fp32
    # copy and a normalized copy of its input. Before the fused cross-entropy (fp32_loss), three
    # fp32 logits-sized tensors at the log-softmax backward.
    assert (byte_counts.loss_temporary_bytes(llama8b, local, tiled=False)
            == local * (128_256 * 4 + 4096 * 4 + 4))
    assert (byte_counts.loss_temporary_bytes(llama8b, local, tiled=False, fused_norm=False)
            == local * (128_256 * 4 + 4096 * 8))
    assert (byte_counts.loss_temporary_bytes(llama8b, local, tiled=False, fp32_loss=True)
            == local * (128_256 * 12 + 4096 * 4 + 4))
    # Tiled: a tile's bf16 logits (at most 1 GiB in fp32) and their gradient; the input and its
    # gradient stay sequence-wide; lm_head's gradient is summed in fp32.
    tiled_loss = byte_counts.loss_temporary_bytes(llama8b, local, tiled=True)
    lm_head_sum = 128_256 * 4096 * 4
    assert (2 * local * 4096 * 2 + lm_head_sum < tiled_loss
            <= 2 * local * 4096 * 2 + lm_head_sum + 2 * 2**30)
    # Untiled: gate and up kept (base/fused.py's SwiGLUDown), five at the backward peak; the
    # rows measured before it kept down_proj's input too ("fused act") and autograd's SwiGLU
    # silu(gate) as well ("autograd").
    assert (byte_counts.mlp_temporary_bytes(llama8b, local, tiled=False, saved_only=True)
            == 21 * 2**30)
    assert byte_counts.mlp_temporary_bytes(llama8b, local, tiled=False) == 52.5 * 2**30
    assert byte_counts.mlp_temporary_bytes(llama8b, local, tiled=False, saved_only=True,
                                           swiglu="fused act") == 31.5 * 2**30
    assert byte_counts.mlp_temporary_bytes(llama8b, local, tiled=False,
                                           swiglu="fused act") == 52.5 * 2**30
    assert byte_counts.mlp_temporary_bytes(llama8b, local, tiled=False,
                                           swiglu="autograd") == 63 * 2**30
    weight_sums = 3 * 4096 * 14336 * 4
    assert byte_counts.mlp_temporary_bytes(llama8b, local, tiled=True) == (
        local * 4096 * 2 + 6 * 4096 * 14336 * 2 + weight_sums)
    assert byte_counts.mlp_temporary_bytes(llama8b, local, tiled=True, saved_only=True) == 0
    assert (byte_counts.mlp_temporary_bytes(llama8b, 100, tiled=True, tile_tokens=1000)
            == 100 * 4096 * 2 + 6 * 100 * 14336 * 2 + weight_sums)
    # The rows measured while each tile ran autograd: a bf16 weight gradient per tile beside
    # the fp32 sums, three fp32 logits-sized tensors in a loss tile's backward (12 bytes per
    # logit against the fused 4), and before the fused cross-entropy two (8 bytes).
    autograd_mlp = byte_counts.mlp_temporary_bytes(llama8b, local, tiled=True,
                                                   autograd_tiles=True)
    assert autograd_mlp == local * 4096 * 2 + 6 * 4096 * 14336 * 2 + 3 * 4096 * 14336 * 6
    loss_tile = tiling.loss_tile_size(128_256, local)
    assert (byte_counts.loss_temporary_bytes(llama8b, local, tiled=True, autograd_tiles=True)
            - tiled_loss == loss_tile * 128_256 * 8 + 128_256 * 4096 * 2)
    assert (byte_counts.loss_temporary_bytes(llama8b, local, tiled=True, fp32_loss=True)
            - tiled_loss == loss_tile * 128_256 * 4)


def test_planner_tiles_are_no_longer_than_the_tokens_and_a_norm_tile_holds_six_fp32():
    """A loss tile given longer than a GPU's tokens (8,192 of 1,024) is those tokens: the input
    and its gradient, the tokens' bf16 logits and their gradient, lm_head's fp32 gradient sum.
    A tiled RMSNorm's backward peaks at one tile's six fp32 tensors (04's rms_norm_backward,
    op by op): 24 bytes x dim a token of a 4,096-token tile."""
    llama8b = llama.get_model_args("llama3-8b")
    assert (byte_counts.loss_temporary_bytes(llama8b, 1024, tiled=True, tile_tokens=8192)
            == 2 * 1024 * 4096 * 2 + 2 * 2 * 1024 * 128_256 + 128_256 * 4096 * 4)
    norms = byte_counts.norm_temporary_bytes(llama8b, 2**17, tile_tokens=4096)
    assert norms["norm_backward"] == 24 * 4096 * 4096


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_tile_sizes_are_refused(bad):
    with torch.device("meta"):
        model = llama.Transformer(ARGS)
    with pytest.raises(ValueError, match=rf"mlp_tile_tokens must be a positive whole number of "
                                         rf"tokens, got {bad!r}"):
        tiling.apply_tiling(model, mlp_tile_tokens=bad)
    with pytest.raises(ValueError, match="loss_tile_tokens must be a positive"):
        tiling.apply_tiling(model, loss_tile_tokens=bad)


def test_apply_tiling_keeps_parameter_names_and_works_on_meta():
    with torch.device("meta"):
        model = llama.Transformer(ARGS)
    names = [n for n, _ in model.named_parameters()]
    tiling.apply_tiling(model, mlp_tile_tokens=4, loss_tile_tokens=4)
    assert [n for n, _ in model.named_parameters()] == names
    assert "forward" in vars(model.layers[0].mlp) and "loss_sum" in vars(model)


# ---------------------------------------------------------------------------------------------
# The full model, built by train.py, against plain single-process training.
# ---------------------------------------------------------------------------------------------

def tiling_config(offload: bool, **techniques) -> "Config":
    """FSDP + Ulysses + tiling, with or without checkpointing + offload (03)."""
    return Config(model="tiny", seq_len=32, batch_size=2, fsdp=True, ulysses=True,
                  checkpoint=offload, offload=offload, **techniques)


# (tile_mlp, tile_loss, tile_norm, mlp/norm tile, loss tile, checkpoint + offload).
# Each rank holds 2 rows x 16 tokens = 32 tokens.
MODEL_CASES = [
    (True, True, True, 8, 8, True),  # tiles divide the local tokens
    (True, True, True, 5, 7, True),  # they don't: last tiles shorter
    (True, True, True, None, None, True),  # shape-derived defaults
    (True, False, False, 3, None, True),
    (False, True, False, None, 3, True),
    (False, False, True, 6, None, True),
    (True, True, True, 5, 7, False),  # without 03
]


def _model_matches_unsharded():
    tokens, labels = make_batch(256, 2, 32, seed=4, ignore_frac=0.3)
    labels[0, :16] = llama.IGNORE_INDEX  # rank 0's whole shard of row 0: all-ignored tiles
    ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels)
    rt = None
    for tile_mlp, tile_loss, tile_norm, mlp_tile, loss_tile, offload in MODEL_CASES:
        cfg = tiling_config(offload, tile_mlp=tile_mlp, tile_loss=tile_loss, tile_norm=tile_norm,
                            mlp_tile_tokens=mlp_tile, loss_tile_tokens=loss_tile)
        rt = rt or setup_runtime(resolve_techniques(cfg))
        # an untiled model computes the same numbers: the build must run the tiles it was given
        applied = techniques_applied(train.build_model(resolve_techniques(cfg), rt))
        assert applied == techniques_of(cfg), applied
        loss, grads = train_loss_and_grads(cfg, tokens, labels, rt)
        assert_matches(loss, grads, ref_loss, ref_grads,
                       what=f"P={dist.get_world_size()} mlp={tile_mlp}/{mlp_tile} "
                            f"loss={tile_loss}/{loss_tile} norm={tile_norm} "
                            f"checkpoint+offload={offload}")


def test_fsdp_ulysses_tiled_model_equals_single_process():
    """P=2, FSDP + Ulysses (with and without checkpointing + offload) with tiling."""
    run_ranks(2, _model_matches_unsharded)


@pytest.mark.slow
def test_train_py_tiles_on_cpu():
    result = subprocess.run([sys.executable, "train.py", "--tile-mlp", "--tile-loss",
                             "--tile-norm", "--steps", "3", "--seq-len", "64",
                             "--mlp-tile-tokens", "5"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # The run's first line names every technique on, --tile-norm too (it is in no --stack).
    assert "techniques: tile_mlp, tile_loss, tile_norm" in result.stdout, result.stdout[:2000]


@pytest.mark.slow
def test_train_py_stack_4():
    result = subprocess.run([sys.executable, "train.py", "--stack", "4", "--steps", "3",
                             "--seq-len", "64"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# GPU: bf16 tiled vs untiled, and the peak memory drops.
# ---------------------------------------------------------------------------------------------

def _peak(run, x):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    x = x.clone().requires_grad_()
    out = run(x)
    out.float().sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out.detach().float(), x.grad.float()


def _gpu_bf16_layer(tokens: int):
    """A one-layer small model with a 32K vocabulary in bf16 on the GPU, a hidden state of
    `tokens` tokens and their labels."""
    args = replace(llama.get_model_args("small"), n_layers=1, vocab_size=32768)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = llama.Transformer(args).to(torch.bfloat16)
        x = torch.randn(1, tokens, args.dim, dtype=torch.bfloat16)
        labels = torch.randint(0, args.vocab_size, (1, tokens))
    return model, x, labels


@pytest.mark.gpu
def test_gpu_bf16_tiled_equals_untiled_with_lower_peak():
    """The tiled MLP and loss in bf16 against the untiled ones in fp32 (the same weights), by the
    one bf16 rule (tests/reference.py), whose unsharded run is the untiled bf16 computation; and
    less than half its peak."""
    model, x, labels = _gpu_bf16_layer(16384)
    model32 = copy.deepcopy(model).float()
    for part, untiled, tiled in [
            ("mlp", lambda m, x: llama.MLP.forward(m.layers[0].mlp, x),
             lambda m, x: tiling.tiled_mlp_forward(m.layers[0].mlp, x, 1024)),
            ("loss", lambda m, h: llama.Transformer.loss_sum(m, h, labels),
             lambda m, h: tiling.tiled_loss_sum(m, h, labels, 1024))]:
        results = {}
        for name, this, run, inputs in (("reference", model32, untiled, x.float()),
                                        ("unsharded", model, untiled, x),
                                        ("tiled", model, tiled, x)):
            peak, out, grad = _peak(partial(run, this), inputs)
            results[name] = {"out": out, "dx": grad, **{
                f"d{n}": p.grad.float().clone() for n, p in this.named_parameters()
                if p.grad is not None}}
            results[name + " peak"] = peak
            this.zero_grad(set_to_none=True)
        assert results["tiled peak"] < results["unsharded peak"] / 2, (part, results)
        assert_within_bf16_error(results["tiled"], results["unsharded"], results["reference"],
                                 f"tiled {part}")


class OpsSeen(TorchDispatchMode):
    """Every ATen op run while active, forward and backward (autograd's device threads too)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
def test_gpu_bf16_weight_gradients_are_one_matmul_into_the_fp32_sum():
    """On CUDA in bf16 every tile's weight gradient is one matmul accumulating into its fp32 sum
    (addmm's out_dtype overload), never the fp32 fallback; and the tiled MLP and loss stay
    within the one bf16 rule of the fp32 untiled ones."""
    model, x, labels = _gpu_bf16_layer(4096)
    labels[0, :1024] = llama.IGNORE_INDEX  # the first loss tile: all ignored
    model32 = copy.deepcopy(model).float()
    for part, untiled, tiled, matmuls in [
            ("mlp", lambda m, x: llama.MLP.forward(m.layers[0].mlp, x),
             lambda m, x: tiling.tiled_mlp_forward(m.layers[0].mlp, x, 1024), 3 * 4),
            ("loss", lambda m, h: llama.Transformer.loss_sum(m, h, labels),
             lambda m, h: tiling.tiled_loss_sum(m, h, labels, 1024), 4)]:
        results = {}
        for name, this, run, inputs in (("reference", model32, untiled, x.float()),
                                        ("unsharded", model, untiled, x),
                                        ("tiled", model, tiled, x)):
            with OpsSeen() as seen:
                _, out, grad = _peak(partial(run, this), inputs)
            results[name] = {"out": out, "dx": grad, **{
                f"d{n}": p.grad.float().clone() for n, p in this.named_parameters()
                if p.grad is not None}}
            this.zero_grad(set_to_none=True)
        assert seen.ops.count(torch.ops.aten.addmm.dtype_out) == matmuls, part
        assert torch.ops.aten.addmm_.default not in seen.ops, part
        assert_within_bf16_error(results["tiled"], results["unsharded"], results["reference"],
                                 f"tiled {part}, fused fp32 sums")


@pytest.mark.parametrize("part", ["mlp", "loss"])
def test_bf16_weight_sums_are_fp32_whatever_the_tile_count(part):
    """In bf16 the weights' sums are fp32 and each tile's product is added unrounded: 50 tiles of
    one token give the weight gradients of one 50-token tile (to within one bf16 rounding)."""
    def grads(tile):
        if part == "mlp":
            mlp, x = _mlp_and_input()
            mlp, x = mlp.bfloat16(), x.bfloat16().requires_grad_()
            grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
            tiling.tiled_mlp_forward(mlp, x, tile).backward(grad_out.bfloat16())
            return {n: p.grad.float() for n, p in mlp.named_parameters()}
        model = _loss_model().bfloat16()
        h = torch.randn(BATCH, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(2))
        tiling.tiled_loss_sum(model, h.bfloat16(), _labels(), tile).backward()
        return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    many, one = grads(1), grads(BATCH * SEQ)
    for name in one:
        torch.testing.assert_close(many[name], one[name], rtol=2**-7, atol=0,
                                   msg=lambda m: f"{part} {name}: {m}")


@pytest.mark.parametrize("tile_tokens", TILE_CASES)
def test_tiled_loss_without_grad_equals_untiled(tile_tokens):
    """Evaluation's path (no backward coming: the tiles' losses alone) adds every tile."""
    model, labels = _loss_model(), _labels()
    h = torch.randn(BATCH, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = llama.Transformer.loss_sum(model, h, labels)
        got = tiling.tiled_loss_sum(model, h, labels, tile_tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
