"""Compare a technique against plain, unsharded, single-process training.

Every equivalence test follows one pattern, run inside each rank of `run_ranks`:

    tokens, labels = make_batch(vocab_size, rows, seq_len)
    ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels)   # no process group
    loss, grads = train_loss_and_grads(Config(model="tiny", fsdp=True, ulysses=True), tokens,
                                       labels)
    assert_matches(loss, grads, ref_loss, ref_grads)

`tokens` is the whole global batch (dp * batch_size, seq_len + 1) and `labels` its next-token
targets (dp * batch_size, seq_len), -100 where ignored: the reference sees all of it,
and the distributed run gives each data-parallel rank its rows and each sequence-parallel rank
its slice, through the same code train.py uses.
"""

import gc
import importlib
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from base import kernels
import model as llama
from support.config import Config, resolve_techniques
from support.runtime import Runtime, setup_runtime
from support import build
from support.lessons import tiling, untied_sp

train = importlib.import_module("train")


def make_batch(vocab_size: int, rows: int, seq_len: int, seed: int = 0, ignore_frac: float = 0.0):
    """Random tokens (rows, seq_len + 1) and labels (rows, seq_len): the tokens shifted by one,
    with a fraction of them ignored."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    if ignore_frac:
        labels[torch.rand(labels.shape, generator=generator) < ignore_frac] = llama.IGNORE_INDEX
    return tokens, labels


def reference_loss_and_grads(model_name: str, tokens: torch.Tensor, labels: torch.Tensor,
                             seed: int = 0, args: llama.ModelArgs | None = None):
    """Plain model, full batch, full sequence, fp32: loss (global token mean) and gradients."""
    args = args or llama.get_model_args(model_name)
    model = llama.Transformer(args)
    llama.init_weights(model, seed)
    input_ids = tokens[:, :-1]
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    count = (labels != llama.IGNORE_INDEX).sum().clamp(min=1)
    loss = model(input_ids, positions, labels) / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor from an FSDP-sharded DTensor (a collective: call on every rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, else `t` (no collective)."""
    return t.to_local() if hasattr(t, "to_local") else t


def parameter_updates(model, initial: dict) -> dict:
    """Each parameter's whole update over a run ("update NAME": final - initial, whole, fp32, on
    the CPU; full() gathers: call on every rank). The update, not the weight: a step skipped or
    taken wrong moves it by all of it."""
    return {f"update {name}": full(p).detach().float().cpu() - initial[name]
            for name, p in model.named_parameters()}


# The tiny preset with 4 layers: 03 and 07 need blocks above and below the ones they act on.
# (Registered at import, so the spawned ranks, which import this module, have it too.)
TINY_4L = "tiny-4L"
llama.PRESETS[TINY_4L] = replace(llama.get_model_args("tiny"), n_layers=4)


def build_as_train(cfg):
    """The model exactly as train.py builds it, its runtime and its resolved Config."""
    cfg = resolve_techniques(cfg)
    rt = setup_runtime(cfg)
    return train.build_model(cfg, rt), rt, cfg


def settled_memory_allocated() -> int:
    """Bytes allocated once the GPU is idle: synchronized, and after one allocation, at which
    the allocator also takes back into its pool what it held for a side stream's use (memory
    freed with record_stream: counted as freed already, reserved until that use is done)."""
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")
    return torch.cuda.memory_allocated()


def live_tensors() -> int:
    """The tensors alive in this process (a leak test's count), after a garbage collection.
    (The warnings ignored: the objects include torch.distributed's deprecated `reduce_op`, which
    warns when asked its class.)"""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def assert_tensors_do_not_accumulate(live: list) -> None:
    """`live`: live_tensors() after each step; the first step (which makes AdamW's state) is
    not compared. A leak adds tensors every step, so the fewest alive in the later half of the
    steps exceed the fewest in the earlier half; a tensor still held at one count and let go
    after (seen once: one more after one step on one gloo rank, then as before) moves one
    count, not the fewest of a half."""
    later = live[1:]
    half = len(later) // 2
    assert half and min(later[half:]) <= min(later[:half]), live


def train_loss_and_grads(cfg, tokens: torch.Tensor, labels: torch.Tensor, rt=None):
    """Build the model exactly as train.py does and run one forward+backward on this rank's
    share of `tokens` (rows of its data-parallel rank). Returns loss and full gradients."""
    cfg = resolve_techniques(cfg)
    rt = rt or setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    rows = tokens.shape[0] // rt.dp
    mine = slice(rt.dp_rank * rows, (rt.dp_rank + 1) * rows)
    loss = train.forward_backward(model, tokens[mine], rt, labels[mine])
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    return loss, grads


def techniques_applied(model) -> dict:
    """The seam-level techniques the built model really runs, each with its setting: "untied"
    (05's attend seam), "tile_mlp", "tile_loss", "tile_norm" (04's tiles: their tile tokens,
    None for the shape-derived default). A build that left one off computes the same numbers,
    so the equivalence tests check this beside them."""
    block = model.layers[0]
    seams = {"untied": block.self_attn.attend, "tile_mlp": block.mlp.forward,
             "tile_loss": model.loss_sum, "tile_norm": block.input_layernorm.forward}
    functions = {"untied": untied_sp.untied_attend, "tile_mlp": tiling.tiled_mlp_forward,
                 "tile_loss": tiling.tiled_loss_sum, "tile_norm": tiling.tiled_norm_forward}
    return {name: getattr(seam, "keywords", {}).get("tile_tokens")
            for name, seam in seams.items() if getattr(seam, "func", None) is functions[name]}


def techniques_of(cfg) -> dict:
    """What techniques_applied should find for `cfg` (resolved: --stack turns the tiles on)."""
    tiles = {"tile_mlp": cfg.mlp_tile_tokens, "tile_loss": cfg.loss_tile_tokens,
             "tile_norm": cfg.mlp_tile_tokens}
    return {name: tiles.get(name) for name in ("untied", "tile_mlp", "tile_loss", "tile_norm")
            if getattr(cfg, name)}


def assert_matches(loss, grads, ref_loss, ref_grads, rtol=1e-5, atol=1e-6, what="",
                   norm_rtol=None):
    """Elementwise (fp32), or with norm_rtol the relative error of each whole tensor,
    ||got - ref|| / ||ref|| (bf16 against an fp32 reference: entries that are themselves
    rounding noise would fail any elementwise bound)."""
    assert torch.isfinite(loss).all(), f"{what}: loss is {loss}"
    assert grads.keys() == ref_grads.keys()
    pairs = [("loss", loss, ref_loss)] + [(f"grad {n}", grads[n], r) for n, r in ref_grads.items()]
    for name, got, ref in pairs:
        assert got is not None, f"{what}: no {name}"
        if norm_rtol is None:
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what} {name}: {m}")
        else:
            error = relative_error(got, ref)
            assert error < norm_rtol, f"{what} {name}: relative error {error:.2e} >= {norm_rtol}"


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| over the whole tensor (or |got - want| / |want| for numbers), in
    float64 on the CPU."""
    got, want = (torch.as_tensor(t).detach().double().cpu() for t in (got, want))
    return ((got - want).norm() / want.norm().clamp(min=1e-12)).item()


# bf16 against fp32: one rule for every GPU test. A technique run in bf16 differs from the fp32
# reference by rounding alone when its error is about that of the same computation done plainly
# in bf16: unsharded, in one process, one kernel call (the "unsharded bf16 run"). The technique
# performs the same bf16 operations in another order, and may round a partial result to bf16
# once more before an exchange (each Ulysses rank's part of a replicated KV head's dK/dV, the
# sum of 4 of 8 query heads' terms; FSDP's bf16 gradients before their fp32 reduce-scatter).
# So each tensor's relative error (over the whole tensor: elements that are themselves rounding
# noise fail any elementwise bound) may be at most BF16_ERROR_FACTOR x the unsharded bf16 run's
# own, plus one more bf16 rounding of the result (BF16_ROUNDING, the unit roundoff of 8
# significant bits). Measured on an H200 (docs/gpu_tests.json, the MQA dV probe): the sharded
# dV's error 1.00-1.15x the unsharded run's over 20 draws. A broken step is off by far more: a
# skipped optimizer step leaves the update 100% wrong, a dropped rank's gradient ~50%, a wrong
# exchange ~100%. The unsharded run shares every part of the step but the technique under test
# (the model, base/fused.py's forms, the attention kernel, FSDP's mixed precision): a fault in a
# shared part moves both runs and this rule cannot see it, so each shared part is held to the
# plain computation by its own test (tests/test_fused.py: the fused forms against model.py's in
# bf16; the kernels against SDPA: plain_attention_results).
BF16_ERROR_FACTOR = 2.0
BF16_ROUNDING = 2.0**-8


def assert_within_bf16_error(got: dict, unsharded: dict, reference: dict, what: str = ""):
    """Each tensor (or number) of `got` (the technique in bf16) within the one bf16 rule of the
    fp32 `reference`, given the unsharded bf16 run's `unsharded` values of the same names."""
    assert got.keys() == reference.keys() == unsharded.keys(), (what, got.keys() ^ reference.keys())
    for name, want in reference.items():
        value = got[name]
        assert value is not None, f"{what}: no {name}"
        assert torch.isfinite(torch.as_tensor(value)).all(), f"{what} {name}: not finite"
        baseline = relative_error(unsharded[name], want)
        allowed = BF16_ERROR_FACTOR * baseline + BF16_ROUNDING
        error = relative_error(value, want)
        assert error <= allowed, (
            f"{what} {name}: relative error {error:.2e} against fp32, more than {allowed:.2e} "
            f"({BF16_ERROR_FACTOR:g} x the unsharded bf16 run's {baseline:.2e} + "
            f"{BF16_ROUNDING:.2e})")


def assert_step_matches(loss, grads, ref_loss, ref_grads, model_name: str, tokens, labels,
                        dtype="float32", what: str = "", norm_rtol=None, documents=None,
                        args=None):
    """A technique's loss and gradients against the fp32 reference: in fp32 as assert_matches
    says; in bf16 by the one bf16 rule, against the unsharded bf16 run of the same batch
    (`tokens`, `labels` or `documents`: the whole global batch)."""
    if str(dtype).removeprefix("torch.") != "bfloat16":
        return assert_matches(loss, grads, ref_loss, ref_grads, what=what, norm_rtol=norm_rtol)
    unsharded = unsharded_bf16_loss_and_grads(model_name, tokens, labels, documents, args)
    assert_within_bf16_error(loss_and_grads_dict(loss, grads), unsharded,
                             loss_and_grads_dict(ref_loss, ref_grads), what)


def plain_attention_results(q, k, v, grad_out, causal: bool = True) -> tuple:
    """The unsharded bf16 run of a kernel's test: PyTorch's SDPA on q, k, v as they are (dtype,
    device; its own choice of backend), one call: (out, dq, dk, dv), (B, S, heads, D)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal,
                                         enable_gqa=True).transpose(1, 2)
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


def loss_and_grads_dict(loss, grads: dict) -> dict:
    """{"loss": loss, "grad <name>": gradient, ...}: one step's results in the rule's form."""
    return {"loss": loss, **{f"grad {name}": g for name, g in grads.items()}}


def unsharded_bf16_loss_and_grads(model_name: str, tokens, labels, documents=None, args=None):
    """The unsharded bf16 run of the rule: the model built as train.py builds it in one process
    (no technique), in bf16 on this GPU, with this process's attention kernel, one forward and
    backward over the whole batch. Returns loss_and_grads_dict's form."""
    cfg = Config(model=model_name, seq_len=tokens.shape[1] - 1, batch_size=tokens.shape[0],
                 device="cuda", dtype="bfloat16", attn_kernel=kernels._requested["kernel"])
    rt = Runtime(device=torch.device("cuda", torch.cuda.current_device()))
    model = train.build_model(cfg, rt) if args is None else build.build_model(
        args, rt.device, None, torch.bfloat16, seed=cfg.seed)
    loss = train.forward_backward(model, tokens, rt, None if documents is not None else labels,
                                  documents)
    return loss_and_grads_dict(loss, {n: p.grad for n, p in model.named_parameters()})


# The GPU kernels the GPU tests run with (tests/test_02, test_05, test_packed): each forced in
# turn, at the head size of real models: FlashAttention-4 4.0.0b36 computes wrong gradients at
# the tiny preset's head_dim 8 (docs/gpu_tests.json), so its kernel check refuses it there.
GPU_HEAD_DIM = 64
llama.PRESETS.setdefault("tiny-hd64", replace(llama.get_model_args("tiny"), head_dim=GPU_HEAD_DIM))
GPU_KERNELS = [pytest.param("cudnn"),
               pytest.param("fa4", marks=pytest.mark.skipif(not kernels.fa4_installed(),
                                                            reason="flash-attn-4 not installed"))]


def with_kernel(kernel, body, *args):
    """In each rank: the attention kernel `kernel` (--attn-kernel), then the test body."""
    kernels.use_kernel(kernel)
    body(*args)
