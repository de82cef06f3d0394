"""plan.py - how much memory a training step needs per GPU, without a GPU; and what a GPU run
takes (every choice in one call: `plan_run`).

    python plan.py --model llama3-8b --gpus 8 --seq-len 3M   # --stack auto: the ranking a run
                                                             # takes the fastest that fits from
    python plan.py --model llama3-8b --seq-len 3M --stack 5 --gpus 8 --gpu-mem 80GiB
    python plan.py --model llama3-8b --gpus 8 --host-mem 2TiB    # longest length per --stack
                                                                 # (--seq-len max, the default)
    python plan.py --model llama3-8b --seq-len max --stack 5 --scaling   # 8..64 GPUs, with and
                                                                 # without --offload-model-state
    python train.py --plan ...                # a training command's plan (training's own
                                              # flags, --lr, --save-dir, ..., left out)
    python plan.py --eval --model llama3-8b --seq-len max --gpus 8  # eval.py's forward only

The bytes each technique leaves on the GPU are counted in support/byte_counts.py, a section per
numbered file (`model_state_bytes` for 01, `attention_activation_bytes` for 02,
`checkpoint_memory_bytes` for 03, `mlp_temporary_bytes` / `loss_temporary_bytes` for 04,
`untied_attention_bytes` for 05, `ring_buffer_bytes` for 06); this file adds them up at the
moments a step can peak. The flags it shares with train.py (one definition,
support/config.py) mean what they mean there; plan.py imports no train.py, and train.py imports
it only where a run plans (a GPU run, --plan).
The counts are calibrated against GPU runs (docs/calibration.md: within a few percent), and
"fits" keeps a margin of the worst under-prediction among them (`PLAN_MARGIN`). The host memory
assumed (--host-mem, per node) can decide an answer: its first line says what was assumed.
A GPU run's choices (--stack auto's techniques; U, --keep-attention, the MLP tile where the flags
leave them open) are the candidates that fit, ranked by support/step_time.py's predicted step
time (calibrated as the bytes are: docs/calibration.md, "Step time"); train.py applies the one
value `plan_run` returns.

Packed documents (--documents) change the plan very little, so it counts them as dense: the
attention holds the same q, k, v, output and log-sum-exp whatever the mask, and positions,
labels and boundaries are a few bytes per token. kernels.py's per-document loop briefly holds one
more output of the attention (or of a 05 stage) in forward and one more dq, dk, dv in backward
while it concatenates the documents' pieces: up to ~15% of 02's attention peak for Llama-3-8B,
not counted here (`DOCUMENTS_NOTE`).
"""

import sys
from dataclasses import dataclass, field, fields, replace
from functools import partial
from itertools import product

import torch

import model
from base import kernels
from support import byte_counts, config, step_time
from support.config import (MAX_STACK, MAX_TOKENS, TECHNIQUES, UNTIED_LEVEL, Config, model_args,
                            model_name, resolve_techniques, techniques_text)
from support.lessons import tiling, untied_sp
from support.runtime import Machine, check_layout

GiB = 2**30
# What a GPU cannot hand to tensors: the CUDA context, NCCL and cuBLAS workspaces, the
# allocator's slack. On a 139.8 GiB H200 a step failed to allocate 0.9 GiB with 136.85 GiB
# allocated (docs/results/progression_llama3-8b_2gpu.json): 2.95 GiB was out of reach.
PLAN_GPU_RESERVE = 3 * GiB
# The planner's worst under-prediction in its calibration (docs/results/plan_calibration.json:
# every GPU measurement next to its plan), as a fraction of the measured peak: the tiled MLP's
# backward at 512K tokens over 2 x H200, 3.781 GiB measured where 3.641 were planned.
# tests/test_plan.py holds it to the calibration's worst row.
WORST_UNDER_PREDICTION = (3.781 - 3.641) / 3.781
# What "fits" adds to a planned peak: enough that a step the planner under-predicts as badly as
# its worst calibration row (a fraction w of the measured peak) still fits:
# planned x (1 + margin) = planned / (1 - w).
PLAN_MARGIN = WORST_UNDER_PREDICTION / (1 - WORST_UNDER_PREDICTION)
DEFAULT_HOST_MEM = "2TiB"  # per node, when --host-mem is not given
DEFAULT_GPU = "NVIDIA H200"  # whose speed rates plan.py predicts with, when --gpu is not given
SP1_HINT_GAIN = 0.03  # a run names one sequence a GPU where it is predicted this much faster
DEFAULT_GPU_MEM = "80GiB"  # per GPU, when neither --gpu-mem nor a known --gpu is given
GPU_MEMORY = {  # what torch.cuda.get_device_properties().total_memory reports (not the nominal)
    "NVIDIA H200": int(139.8 * 2**30),
    "NVIDIA H100 80GB HBM3": int(79.18 * 2**30),
}
DOCUMENTS_NOTE = ("packed documents: planned as dense (same attention tensors); the per-document "
                  "loop adds up to one attention output and one dq/dk/dv while concatenating")
PLAN_COMPONENTS = {  # component -> (label, when nothing is checkpointed, when some blocks are)
    "saved": ("checkpoints on GPU", "other layers' activations (norms, MLP)",
              "checkpoints, and the other blocks' norms and MLP"),
    "block": ("one block's recompute + temporaries", None, None),
    "loss": ("loss temporaries", None, None),
    "fsdp": ("FSDP gathered params / unsharded grads", None, None),
}
GPUS_PER_NODE = 8  # host memory (--host-mem) is per node, shared by its GPUs


def parse_bytes(text: str) -> int:
    """'80GiB', '141GiB', '2TiB', '512GB', '1.5T' -> bytes. KiB/MiB/GiB/TiB and a bare K/M/G/T
    are powers of 2; KB/MB/GB/TB powers of 10."""
    value = str(text).strip()
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 10**12, "GB": 10**9,
             "MB": 10**6, "KB": 10**3, "T": 2**40, "G": 2**30, "M": 2**20, "K": 2**10, "B": 1}
    unit = next((u for u in units if value.upper().endswith(u)), "")
    try:
        number = float(value[:len(value) - len(unit)]) if unit else None
    except ValueError:
        number = None
    if number is None:
        raise ValueError(f"cannot read a memory size from {text!r} (try 80GiB, 2TiB or 512GB)")
    if not 0 < number < float("inf"):
        raise ValueError(f"a memory size must be positive and finite, got {text!r}")
    if number * units[unit] < 1:
        raise ValueError(f"a memory size must be at least one byte, got {text!r}")
    return int(number * units[unit])


def planned_kernel(cfg: Config) -> str:
    """The attention kernel whose backward workspace the plan counts: --attn-kernel, or for
    auto FlashAttention-4 where it is installed, else cuDNN (plan for FA4 with
    --attn-kernel fa4)."""
    if cfg.attn_kernel in ("fa4", "flash"):
        return cfg.attn_kernel
    return "fa4" if cfg.attn_kernel == "auto" and kernels.fa4_installed() else "cudnn"


def plan_memory(cfg: Config, world_size: int, args=None, adam_allocated: bool = True,
                forward_only: bool = False, fused_norm: bool = True,
                autograd_tiles: bool = False, swiglu: str | None = None,
                fp32_loss: bool = False, norm_outputs_kept: bool = False,
                one_rank_copied: bool = False) -> dict:
    """Per-GPU bytes of one training step of `cfg` on `world_size` GPUs, at the moments where
    the step can peak, by component; every count comes from support/byte_counts.py.

      end of forward (loss):      what forward keeps (checkpoints, or every layer's
                                  activations) and the loss's temporaries;
      backward of the last layer: all checkpoints still on the GPU, one block's backward;
      backward of layer 1:        (offloaded) two checkpoints, all but two layers' gradients;
      backward of layer 0:        one checkpoint left, the other layers' gradients;
      end of backward:            the root's gradients on their way to the reduce-scatter;
      optimizer step:             the whole model state and AdamW's temporaries.
    One block's backward peaks at its MLP, its post-attention RMSNorm or its attention.
    adam_allocated=False: the first step, whose optimizer step allocates Adam's moments.
    With --offload-model-state (01) the model state and the optimizer step leave the GPU; it
    keeps the shards in flight between host and GPU, and the host holds the state.
    Returns {"moments": {moment: {component: bytes}}, "peak_moment", "peak", "block_moment",
    "host" (host bytes per GPU), "host_parts" ({"checkpoints", "model state"}), "model_state"
    (on the GPU), "local_tokens", "sp", "dp", "head_chunk"}.
    forward_only=True: evaluation's forward instead (`plan_forward_memory`).
    fused_norm=False: the RMSNorms op by op, as the GPU calibration rows so marked measured them
    (byte_counts.block_recompute_bytes); F.rms_norm is one fused kernel on CUDA.
    autograd_tiles=True: 04's tiles as the GPU calibration rows so marked measured them, each
    running autograd (byte_counts' note in its 04 section); swiglu: what the untiled MLP kept
    before base/fused.py's SwiGLUDown (byte_counts.SWIGLU_KEPT; the rows say so); fp32_loss=True:
    the loss's cross-entropy with fp32 logits, as before base/fused.py's (the rows say so);
    norm_outputs_kept=True: the blocks 03 leaves unchecked keep their norms' outputs, as before
    its recompute_norms (the rows say so); one_rank_copied=True: one GPU's reduce-scatter
    copied its input into an output of its own, as before 01 reduced one rank in place (the
    rows say so).
    """
    if forward_only:
        return plan_forward_memory(cfg, world_size, args, fused_norm, fp32_loss)
    args = args or model_args(cfg)
    sp, ring, head_chunk = check_layout(cfg, world_size, args)  # 06: Ulysses P/R x ring R
    b = getattr(torch, cfg.dtype).itemsize
    tokens = cfg.batch_size * cfg.seq_len  # per data-parallel rank
    local_tokens = tokens // sp
    hidden = local_tokens * args.dim * b  # a block's input or output, or its gradient
    n_layers = args.n_layers
    n_params = model.num_params(args)
    block_params = byte_counts.block_params(args)
    if cfg.fsdp:  # fp32 master weights, gradients and Adam, sharded; bf16 copies gathered
        state = byte_counts.model_state_bytes(args, world_size)
        # 01 reduces one rank in place, but where the state goes to the host (FSDP2's own);
        # a later micro-batch's input (--grad-accum) is added into the gradients and held
        in_place = (world_size == 1 and not cfg.offload_model_state and cfg.grad_accum == 1
                    and not one_rank_copied)
        buffers = byte_counts.fsdp_buffer_bytes(args, b, world_size, in_place)
    else:  # one process: the model, its gradients and Adam's two moments in the compute dtype
        state = {"parameters": b * n_params, "gradients": b * n_params,
                 "optimizer": 2 * b * n_params}
        buffers = dict.fromkeys(("after_forward", "during_backward", "below_the_top",
                                 "bottom_block", "end_of_backward"), 0)
    # The fused AdamW (train.make_optimizer) updates in place: its step allocates nothing.
    host_state = 0
    if cfg.offload_model_state:  # 01: the same shards in host memory; AdamW steps there (fused)
        host_state = sum(byte_counts.offloaded_model_state_bytes(args, world_size).values())
        transfers = byte_counts.offload_transfer_bytes(args, world_size)
        buffers = {moment: n + transfers[moment] for moment, n in buffers.items()}
        state = dict.fromkeys(state, 0)

    # 02's or 05's count (with a ring: over a ring rank's S/R tokens, the ring's buffers in
    # place of one kernel's workspace)
    attention = partial(byte_counts.hybrid_attention_bytes, args, tokens, sp, ring, b,
                        kernel=planned_kernel(cfg), untied=cfg.untied, head_chunk=head_chunk)
    mlp = partial(byte_counts.mlp_temporary_bytes, args, local_tokens, cfg.tile_mlp,
                  cfg.mlp_tile_tokens, b, autograd_tiles=autograd_tiles, swiglu=swiglu)
    attention_saved, mlp_saved = attention(saved_only=True), mlp(saved_only=True)
    norms = (byte_counts.norm_temporary_bytes(args, local_tokens, cfg.mlp_tile_tokens, b,
                                              fused_norm, autograd_tiles) if cfg.tile_norm
             else byte_counts.block_recompute_bytes(args, local_tokens, b, fused_norm))
    loss = byte_counts.loss_temporary_bytes(args, local_tokens, cfg.tile_loss,
                                            cfg.loss_tile_tokens, b, fused_norm, autograd_tiles,
                                            fp32_loss)

    # One block's backward, after checkpointing rebuilt what it saved: (attention, the rest).
    # The gradient of its output stays until its first RMSNorm's input gradient is added to it.
    first_norm = norms["first_norm"]  # kept until the block's input gradient is done
    # At Ulysses' kernel backward two token-layout tensors of its standalone count are gone in
    # a block: o_proj's input (o_proj's backward ran first) and the output gradient (exchanged
    # into the head layout, then dropped). Untied Ulysses keeps both: it saved its output and
    # slices the output gradient stage by stage. (Measured at 128K-1M, docs/calibration.md.)
    token_layout = (local_tokens * args.n_heads * args.head_dim * b
                    if cfg.ulysses and not cfg.untied and sp // ring > 1 else 0)
    # A block 03 leaves unchecked released its norms' outputs (03's recompute_norms): until
    # backward reaches its attention, the first one is still released.
    released = 0 if norm_outputs_kept or not cfg.checkpoint else norms["released"]

    def block_moments(first_output_released=0):
        return {
            "its MLP": (attention_saved, norms["saved"] - first_output_released + hidden + mlp()),
            "its post-attention RMSNorm": (attention_saved, first_norm - first_output_released
                                           + norms["post_norm_input"] + 2 * hidden
                                           + norms["norm_backward"]),
            "its attention": (attention() - token_layout,
                              first_norm + 2 * hidden - token_layout),
        }

    moments_of_a_block = {"checkpointed": block_moments(), "plain": block_moments(released // 2)}
    block_peaks = {kind: max(moments, key=lambda m: sum(moments[m]))
                   for kind, moments in moments_of_a_block.items()}

    params, grads = state["parameters"], state["gradients"]
    # 09: the blocks' moments in host memory; on the GPU the root's, and from the optimizer step
    # to the end of the next forward SLOTS blocks' in their slots (the first step's too: 09
    # makes the moments on the host before it)
    streamed = (byte_counts.streamed_moment_bytes(args, world_size, cfg.fsdp, b)
                if cfg.offload_moments else {"block": 0, "host": 0, "slots": 0})
    gpu_adam = state["optimizer"] - streamed["host"]
    adam = gpu_adam if adam_allocated or cfg.offload_moments else 0
    # 03 checkpoints the first k blocks (--checkpoint-layers; all by default); the `plain` ones
    # above them keep what they saved, as without checkpointing, until backward reaches them:
    # the norms' and the MLP's tensors (`layer`), the attention's, and the block input where a
    # fused or tiled norm saved it (a checkpointed block's input is its checkpoint).
    k = config.checkpointed_layers(cfg, n_layers)
    plain = n_layers - k
    if 2 * cfg.offload_activations > plain:
        raise ValueError(f"--offload-activations {cfg.offload_activations} needs twice as many "
                         f"blocks that 03 leaves unchecked (a kept one above each); {k} of "
                         f"{n_layers} are checkpointed")
    layer = norms["saved"] - released + norms["block_input"] + mlp_saved
    # 07: every other plain block from layer k on (k, k + 2, .., `top`) keeps all it saved
    # (its norms' outputs too) in host memory, each with a kept block above it. In forward a
    # block's tensors go once the next offloaded block's forward is done (the top one's after
    # the block above it): all are off the GPU at its end. In backward each comes back during
    # the backward of the kept block above it: one beside that block's own.
    offloaded = cfg.offload_activations
    top = k + 2 * (offloaded - 1)
    offloaded_layer = layer + released  # (its attention's tensors: attention_saved)
    # --keep-attention: what a checkpointed block keeps besides its input. In a block's backward
    # its own kept output and log-sum-exp are what its attention saved (counted there).
    kept_tensors = (byte_counts.kept_attention_bytes(args, tokens, sp, b)
                    if k and cfg.keep_attention else [])
    kept = sum(kept_tensors)
    checkpoints = byte_counts.checkpoint_memory_bytes(args, tokens, sp, cfg.offload, b,
                                                        pinned=True, also_kept=kept_tensors,
                                                        layers=k)
    host = checkpoints["host"]
    host_activations = offloaded * (offloaded_layer + attention_saved)

    def waiting(plain_blocks, saved, back=0):  # the plain blocks' activations, `back` offloaded
        # blocks' brought back, and `saved` besides
        return {"saved": saved + plain_blocks * layer + back * offloaded_layer,
                "attention": (plain_blocks + back) * attention_saved}

    kept_plain = plain - offloaded  # the plain blocks that keep their activations on the GPU
    forward_kept = waiting(kept_plain, checkpoints["gpu"])
    # The backward of the last checkpointed block: all checkpoints still on the GPU; offloaded,
    # its own input (it stayed) and the one below, brought back ahead of time (if there is one
    # below: a single checkpointed block keeps its only input on the GPU).
    prefetched = hidden + kept if cfg.offload and k > 1 else 0
    last_checkpointed = waiting(0, checkpoints["gpu"] - kept + prefetched)
    # A plain block's backward: the checkpoints, the plain blocks below it, and its own input
    # where its norm saved it.
    # (07: with the top offloaded block just below it, that block comes back beside it)
    top_below_last = offloaded and top == n_layers - 2
    last_layer_kept = (waiting(kept_plain - 1, checkpoints["gpu"] + norms["block_input"],
                               back=int(top_below_last))
                       if plain else last_checkpointed)
    first_layer_kept = waiting(0, hidden if k else norms["block_input"])

    def backward_of(kept, model_state, fsdp="below_the_top", block="checkpointed"):
        # fsdp: fsdp_buffer_bytes' moment; block: the running block, checkpointed or plain
        block_attention, block_rest = moments_of_a_block[block][block_peaks[block]]
        return {"model_state": model_state, "attention": kept["attention"] + block_attention,
                "saved": kept["saved"], "block": block_rest, "fsdp": buffers[fsdp]}

    # --grad-accum: from the second micro-batch on, the gradients so far (sharded under FSDP)
    # are held through its forward and backward.
    held_grads = grads if cfg.grad_accum > 1 else 0

    def with_grads_of(blocks):  # the model state once `blocks` blocks have their gradients
        return params + adam + max(blocks * grads * block_params // n_params, held_grads)

    # Below the last layer, each block's backward holds fewer activations and more gradients
    # than the one above, so within the plain blocks and within the checkpointed ones the most
    # is at either end: the last layer and the lowest plain block (layer k); the last
    # checkpointed block (layer k - 1) and layer 0. Offloaded, a middle checkpointed block
    # holds two checkpoints (its own and the one below, coming back ahead of time) and the
    # gradients of the layers above it: most at layer 1, where only two layers' gradients are
    # still to come. It outweighs the last checkpointed block (the same two checkpoints, fewer
    # gradients) always, and layer 0 once a block input is larger than one layer's gradients.
    # With 07, the lowest plain block is offloaded: running, it has its norms' outputs back (the
    # moments of a checkpointed block); the kept block above it has it back below it, with
    # more gradients than the last layer.
    middle = {}
    last_block = "plain" if plain else "checkpointed"
    lowest_plain = "checkpointed" if offloaded else "plain"
    if k and plain > 1:
        middle[f"backward of layer {k}"] = backward_of(waiting(0, checkpoints["gpu"]
                                                               + norms["block_input"]),
                                                       with_grads_of(plain - 1),
                                                       block=lowest_plain)
    if offloaded and k + 1 < n_layers - 1:
        middle[f"backward of layer {k + 1}"] = backward_of(
            waiting(0, checkpoints["gpu"] + norms["block_input"], back=1),
            with_grads_of(plain - 2), block="plain")
    if offloaded > 1 and top + 1 < n_layers - 1:  # the top one back below the highest kept
        middle[f"backward of layer {top + 1}"] = backward_of(  # with an offloaded one below
            waiting(offloaded - 1, checkpoints["gpu"] + norms["block_input"], back=1),
            with_grads_of(n_layers - top - 2), block="plain")
    if plain and k > 1:
        middle[f"backward of layer {k - 1}"] = backward_of(last_checkpointed, with_grads_of(plain))
    if cfg.offload and k > 2:
        middle["backward of layer 1"] = backward_of(last_checkpointed, with_grads_of(n_layers - 2))
    # 08: each block keeps its gradients until its next forward (the root's go first), so the
    # forward of layer j holds those of the blocks above it. The backward of layer j holds as
    # much and more: the same blocks' activations below it, the same gradients above it, the
    # root's and the block's backward. So 08 adds no moment of its own; it adds to 07's
    # forward moments, which have more offloaded blocks' tensors than any backward. (The first
    # step updates at once: Adam's moments are allocated then.)
    behind = cfg.overlap_optimizer and adam_allocated

    def forward_state(layer):  # the model state during the forward of `layer` (09: its slots
        # held until the last block's update is done and its copy out, late in the forward)
        return (streamed["slots"] + (with_grads_of(n_layers - 1 - layer) if behind
                                     else params + adam + held_grads))

    # 07's forward holds most at the end of the top offloaded block's forward (its tensors,
    # the previous offloaded block's, going now, and the kept blocks below it) or of the kept
    # block's above it (the top one's, going then); FSDP then holds the running block's
    # parameters gathered and the next one's, as in backward.
    def in_forward(layer, kept_blocks, offloaded_blocks):
        return {"model_state": forward_state(layer),
                **waiting(kept_blocks, checkpoints["gpu"], back=offloaded_blocks),
                "fsdp": buffers["during_backward"]}

    forward_moments = {} if not offloaded else {
        f"forward of layer {top}": in_forward(top, offloaded - 1, min(offloaded, 2)),
        f"forward of layer {top + 1}": in_forward(top + 1, offloaded, 1)}
    moments = {
        **forward_moments,
        "end of forward (loss)": {"model_state": params + adam + held_grads + streamed["slots"],
                                  **forward_kept,
                                  "loss": loss, "fsdp": buffers["after_forward"]},
        "backward of the last layer": backward_of(last_layer_kept, with_grads_of(0),
                                                  "during_backward", last_block),
        **middle,
        "backward of layer 0": backward_of(first_layer_kept, with_grads_of(n_layers - 1),
                                           "during_backward" if n_layers == 1 else "bottom_block"),
        "end of backward": {"model_state": params + adam + grads,
                            "fsdp": buffers["end_of_backward"]},
        "optimizer step": {"model_state": params + grads + gpu_adam + streamed["slots"]},
        **({} if not cfg.offload_moments else {  # its slots, beside 08's held gradients
            "forward of layer 0 (09's moments streaming)": backward_of(
                first_layer_kept, forward_state(0), "bottom_block")}),
    }
    peak_moment = max(moments, key=lambda m: sum(moments[m].values()))
    running = {"backward of the last layer": last_block, f"backward of layer {k}": lowest_plain,
               **({f"backward of layer {k + 1}": "plain", f"backward of layer {top + 1}": "plain"}
                  if offloaded else {})}
    return {"moments": moments, "peak_moment": peak_moment,
            "peak": sum(moments[peak_moment].values()),
            "block_moment": block_peaks[running.get(peak_moment, "checkpointed")],
            "host": host + host_state + host_activations + streamed["host"],
            "host_parts": {"checkpoints": host, "model state": host_state,
                           "activations (07)": host_activations,
                           "Adam's moments (09)": streamed["host"]},
            "model_state": sum(state.values()), "local_tokens": local_tokens,
            "sp": sp, "dp": world_size // sp, "head_chunk": head_chunk, "ring": ring}


def plan_forward_memory(cfg: Config, world_size: int, args=None,
                        fused_norm: bool = True, fp32_loss: bool = False) -> dict:
    """Per-GPU bytes of one evaluation forward (eval.py: torch.no_grad, nothing kept for a
    backward), in plan_memory's form. Not yet calibrated on a GPU; counted as follows, with N
    local tokens, hidden = N x dim, Q = N x heads x D, K = N x max(KV heads, sp) x D values:
      model state: the parameters only (FSDP: the fp32 shards; one process: compute dtype);
      FSDP: the root's parameters gathered in the compute dtype (kept after forward) and two
        blocks' (the running one and the next, prefetched);
      activations: no block keeps anything for later; the running block holds its input x, and
        at its attention the normed input (2 hidden), at its post-attention norm x and h
        (2 hidden), at its MLP x, h and the normed h (3 hidden), besides their temporaries:
        Ulysses (sp > 1) q, k, v in the token and the head layout, the output in the head layout
        and the two buffers of the exchange back (5Q + 4K) with the kernel's fp32 log-sum-exp;
        one process q, k, v and the output (2Q + 2K); Untied Ulysses its output buffer (Q), the
        stages' log-sum-exps, and at one stage its KV group's k, v and the stage's q, output and
        exchange buffers (2 kv_s + 4 q_s); the MLP gate, up and their activation (3 x N x
        ffn), tiled: its output buffer and one tile's; an RMSNorm nothing beyond its output (the
        fused kernel; op by op, fused_norm=False, two fp32 copies: 8 bytes x hidden values),
        tiled: its output and one tile's; the loss seam (per-token scores) the final norm's
        output (op by op with its two fp32 copies) and the logits in the compute dtype, which
        base/fused.py's logit_scores reads in one kernel (fp32_loss=True, model.py's form and the
        rows measured before: also their fp32 copy and its log-softmax), tiled: one tile's (the
        scores themselves: 8 bytes per token). Rotary tables are left out.
    """
    args = args or model_args(cfg)
    sp, ring, head_chunk = check_layout(cfg, world_size, args)
    ulysses_size = sp // ring  # with 06's ring: the head layout holds S/R tokens, not S
    b = getattr(torch, cfg.dtype).itemsize
    tokens = cfg.batch_size * cfg.seq_len
    n = tokens // sp  # local tokens
    hidden = n * args.dim * b
    root = model.num_params(replace(args, n_layers=0))
    block = (model.num_params(args) - root) // max(args.n_layers, 1)
    if cfg.fsdp:
        params = byte_counts.model_state_bytes(args, world_size)["parameters"]
        gathered = b * (root + min(args.n_layers, 2) * block)
    else:
        params, gathered = b * model.num_params(args), 0
    q = n * args.n_heads * args.head_dim * b
    lse = n * args.n_heads * 4
    if cfg.untied:
        u = head_chunk // ulysses_size  # query heads per rank and stage
        kv_heads = (max(1, u // (args.n_heads // args.n_kv_heads))
                    if args.n_kv_heads >= ulysses_size else 1)
        q_stage = n * head_chunk * args.head_dim * b
        kv_stage = n * ulysses_size * kv_heads * args.head_dim * b
        attention = q + lse + 2 * kv_stage + 4 * q_stage
        ring_heads = (u, kv_heads)
    elif ulysses_size > 1:
        attention = 5 * q + 4 * n * max(args.n_kv_heads, ulysses_size) * args.head_dim * b + lse
        ring_heads = (args.n_heads // ulysses_size,
                      max(args.n_kv_heads, ulysses_size) // ulysses_size)
    else:
        attention = 2 * q + 2 * n * args.n_kv_heads * args.head_dim * b + lse
        ring_heads = (args.n_heads, args.n_kv_heads)
    if ring > 1:  # the ring's forward: the K/V block arriving, the fp32 output accumulator
        heads, kv_heads = ring_heads
        attention += (2 * (tokens // ring) * kv_heads * args.head_dim * b
                      + (tokens // ring) * heads * args.head_dim * 4)
    mlp_tile = min(tiling.mlp_tile_size(args.dim, n, cfg.mlp_tile_tokens), n)
    mlp = (hidden + 3 * mlp_tile * args.ffn_dim * b) if cfg.tile_mlp else 3 * n * args.ffn_dim * b
    norm_bytes_per_token = 0 if fused_norm else 8 * args.dim  # op by op: two fp32 copies
    norm = (hidden + norm_bytes_per_token * mlp_tile) if cfg.tile_norm else norm_bytes_per_token * n
    # lm_head's output; model.py's form also its fp32 copy and their log-softmax
    logit_bytes = (b + (4 if b < 4 else 0) + 4) if fp32_loss else b
    loss_tokens = (min(tiling.loss_tile_size(args.vocab_size, n, cfg.loss_tile_tokens), n)
                   if cfg.tile_loss else n)
    loss = 8 * n + hidden + loss_tokens * (args.vocab_size * logit_bytes + norm_bytes_per_token)
    state = {"model_state": params, "fsdp": gathered}
    moments = {
        "a block's attention": {**state, "saved": 2 * hidden, "attention": attention},
        "a block's post-attention RMSNorm": {**state, "saved": 2 * hidden, "block": norm},
        "a block's MLP": {**state, "saved": 3 * hidden, "block": mlp},
        "the loss (per-token scores)": {**state, "saved": hidden, "loss": loss},
    }
    peak_moment = max(moments, key=lambda m: sum(moments[m].values()))
    return {"moments": moments, "peak_moment": peak_moment,
            "peak": sum(moments[peak_moment].values()), "block_moment": peak_moment, "host": 0,
            "model_state": params, "local_tokens": n, "sp": sp, "dp": world_size // sp,
            "head_chunk": head_chunk, "ring": ring, "forward_only": True}


def fewest_stages_that_fit(cfg: Config, world_size: int, gpu_mem: int,
                           forward_only: bool = False) -> int:
    """Untied Ulysses' head chunk by memory alone (eval.py's forward, the longest-length tables;
    a training run's comes from plan_run's ranking, which agrees where nothing else varies):
    the largest valid U (fewest stages) whose planned step fits (fits_on_gpu), else U = P.
    Fewer, bigger stages run faster (bigger kernels and matmuls, fewer exchanges; README,
    throughput); the memory that U = P saves matters only near the longest length that fits, and
    there only U = P fits. One stage holds more memory than Ulysses (its backward keeps the output
    and the input-gradient buffer besides every head's q, k, v): it is chosen only where that fits.
    Training passes the memory torch reports (139.8 GiB on an H200); --plan passes --gpu-mem."""
    args = model_args(cfg)
    sp, ring, least_memory = check_layout(replace(cfg, head_chunk=None), world_size, args)
    ulysses_size = sp // ring  # U is a multiple of the Ulysses degree
    for chunk in sorted(untied_sp.valid_head_chunks(args, ulysses_size), reverse=True):
        plan = plan_memory(replace(cfg, head_chunk=chunk), world_size, args,
                           forward_only=forward_only)
        if fits_on_gpu(plan["peak"], gpu_mem):
            return chunk
    return least_memory


def fewest_checkpointed_layers_that_fit(cfg: Config, world_size: int, gpu_mem: int,
                                        headroom: int = 0) -> int:
    """03's checkpointed blocks k (--checkpoint-layers): the smallest k whose planned step fits
    (fits_on_gpu, with its margin) and leaves `headroom` bytes free at its peak, else all
    n_layers. Each block left out skips its recompute (a forward pass of the block), and its
    activations outweigh its checkpoint, so the planned peak falls as k grows: the first k
    that fits is the fastest that does, unless a few more leave the allocator the room it
    retries without (the speed model weighs both: rank_candidates)."""
    if not cfg.checkpoint:
        raise ValueError("the checkpointed layers are a setting of --checkpoint (03)")
    args = model_args(cfg)

    def enough(k):
        peak = plan_memory(replace(cfg, checkpoint_layers=k), world_size, args)["peak"]
        return fits_on_gpu(peak, gpu_mem) and free_at_peak(peak, gpu_mem) >= headroom

    # the peak falls as k grows (to the L - 2N that leave 07's N blocks and the kept ones above
    # them): bisect for the first
    low, high = 1, args.n_layers - 2 * cfg.offload_activations
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle + 1, high)
    return low


# 04's MLP tiles a GPU run weighs besides 04's default of about dim tokens (candidate_configs):
# larger tiles run the MLP's matmuls over more rows and add up fewer fp32 weight gradients
# (16K-token tiles took 1.3% off a 128K Llama-3-8B step, docs/results.md).
MLP_TILE_CHOICES = (32768, 16384, 8192)  # tokens


def gpus_sharing_a_node(world_size: int, gpus_per_node: int = GPUS_PER_NODE) -> int:
    return min(world_size, gpus_per_node)


def fits_on_gpu(peak: int, gpu_mem: int) -> bool:
    """The one definition of "fits" on a GPU (the plan's answer, the longest length, and what
    training chooses: the head chunk, --keep-attention, the MLP tile): the planned peak plus the
    margin within the GPU less PLAN_GPU_RESERVE."""
    return peak * (1 + PLAN_MARGIN) <= gpu_mem - PLAN_GPU_RESERVE


def gpu_kind(name: str) -> str:
    """--gpu as a GPU_RATES key: the name itself, or the one key it is a part of (any case:
    "h100" is "NVIDIA H100 80GB HBM3"); else the name as given (the memory-only choice)."""
    if name in step_time.GPU_RATES:
        return name
    matches = [kind for kind in step_time.GPU_RATES if name.lower() in kind.lower()]
    return matches[0] if len(matches) == 1 else name


def free_at_peak(peak: int, gpu_mem: int) -> int:
    """What a plan's peak leaves of the GPU's usable memory (less PLAN_GPU_RESERVE), without the
    margin: the speed model's allocator term (step_time.predicted_retries) weighs it."""
    return gpu_mem - PLAN_GPU_RESERVE - peak


def margin_text() -> str:
    return (f"a {PLAN_MARGIN:.1%} margin on each planned peak (the planner's worst "
            f"under-prediction in calibration: {WORST_UNDER_PREDICTION:.1%} of a measured peak)")


def plan_fits(plan: dict, world_size: int, gpu_mem: int, host_mem: int,
              gpus_per_node: int = GPUS_PER_NODE) -> tuple:
    """(fits on each GPU, fits in host memory): the peak with its margin (fits_on_gpu); what
    each GPU keeps on the host (offloaded checkpoints, model state), times the GPUs of one
    node, within the node's host memory `host_mem`."""
    return (fits_on_gpu(plan["peak"], gpu_mem),
            plan["host"] * gpus_sharing_a_node(world_size, gpus_per_node) <= host_mem)


def plan_longest_seq_len(cfg: Config, world_size: int, gpu_mem: int, host_mem: int,
                         limit: int | None = None, gpus_per_node: int = GPUS_PER_NODE,
                         forward_only: bool = False):
    """(longest sequence length that fits, its plan): the largest multiple of sp x 1,024 tokens
    (so every rank gets whole K-token shards) up to `limit` (default: the 2^31 tokens a step
    may hold) whose plan fits on the GPUs and the host (plan_fits, with the margin); (0, None)
    when none does. The plan's "limit" names what one more step of sp x 1,024 tokens would not
    fit: "GPU", "host" or both, or "length cap". Raises training's ValueError for an impossible
    setup."""
    sp, _, _ = check_layout(replace(cfg, seq_len=None), world_size, model_args(cfg))
    step = sp * 1024
    limit = limit or MAX_TOKENS // cfg.batch_size

    def fits_at(multiple):
        plan = plan_memory(replace(cfg, seq_len=multiple * step), world_size,
                           forward_only=forward_only)
        return plan, plan_fits(plan, world_size, gpu_mem, host_mem, gpus_per_node)

    low, high, best = 0, limit // step, None  # memory grows with the length: bisect
    while low < high:
        middle = (low + high + 1) // 2
        plan, fits = fits_at(middle)
        if not all(fits):
            high = middle - 1
        else:
            low, best = middle, plan
    if best is not None:
        gpu_fits, host_fits = fits_at(low + 1)[1] if low < limit // step else (True, True)
        best["limit"] = " and ".join(name for name, fits in (("GPU", gpu_fits), ("host", host_fits))
                                     if not fits) or "length cap"
    return low * step, best


def plan_tokens_text(n: int) -> str:
    short = (f"{n // 2**20}M" if n % 2**20 == 0 else f"{n / 2**20:.2f}M" if n >= 2**20
             else f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}")
    return f"{n:,} ({short})"


def plan_peak_text(plan: dict) -> str:
    """Where the step peaks: the moment, and within a block's backward the part of the block."""
    moment = plan["peak_moment"]
    return moment + (f" (at {plan['block_moment']})" if moment.startswith("backward of") else "")


def gpus_text(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def gpu_fit_text(peak: int, gpu_mem: int) -> str:
    """Whether `peak` fits (fits_on_gpu), with the numbers; "at the edge" where it fits the
    usable memory only without the margin."""
    usable, with_margin = gpu_mem - PLAN_GPU_RESERVE, peak * (1 + PLAN_MARGIN)
    text = (f"{'fits' if fits_on_gpu(peak, gpu_mem) else 'does NOT fit'} in {usable / GiB:.1f} "
            f"usable of {gpu_mem / GiB:.1f} (with the {PLAN_MARGIN:.1%} margin: "
            f"{with_margin / GiB:.1f})")
    if peak <= usable < with_margin:
        text += (": at the edge, where the planner has been a few percent low: it may run out of "
                 "memory")
    return text


def plan_with_head_chunk(cfg: Config, world_size: int, gpu_mem: int, forward_only: bool = False):
    """(cfg, its plan) with Untied Ulysses' head chunk as training (or eval.py) on such GPUs
    would choose it when --head-chunk is not given."""
    if cfg.untied and cfg.head_chunk is None:
        cfg = replace(cfg, head_chunk=fewest_stages_that_fit(cfg, world_size, gpu_mem,
                                                             forward_only))
    return cfg, plan_memory(cfg, world_size, forward_only=forward_only)


def stack_level(cfg: Config) -> int:
    """The highest --stack level whose techniques are all on in cfg (05 stands in for 02)."""
    on = lambda flag: getattr(cfg, flag) or (flag == "ulysses" and cfg.untied)  # noqa: E731
    return max(level for level in range(MAX_STACK + 1)
               if all(on(flag) for flag, first in TECHNIQUES if first <= level))


def what_would_fit(cfg: Config, world_size: int, gpu_mem: int, host_mem: int,
                   gpus_per_node: int = GPUS_PER_NODE) -> str:
    """For a step that does not fit: the first single change that the planner says fits, tried
    in this order: more --checkpoint-layers, more --stack, --offload-model-state, a smaller
    --head-chunk, no --keep-attention, more GPUs (2x .. 16x), a shorter --seq-len."""
    changes = []
    if cfg.checkpoint_layers is not None:  # the fewest checkpointed blocks that fit
        k = fewest_checkpointed_layers_that_fit(cfg, world_size, gpu_mem)
        changes.append((f"--checkpoint-layers {k}", replace(cfg, checkpoint_layers=k), world_size))
    # (from 05's level its Untied Ulysses takes 02's place: --ulysses goes)
    changes += [(f"--stack {level}" + (" without --ulysses" if cfg.ulysses
                                       and level >= UNTIED_LEVEL else ""),
                 replace(cfg, stack=level, ulysses=cfg.ulysses and level < UNTIED_LEVEL),
                 world_size) for level in range(stack_level(cfg) + 1, MAX_STACK + 1)]
    if cfg.fsdp and not cfg.offload_model_state and not cfg.overlap_optimizer:
        changes.append(("--offload-model-state", replace(cfg, offload_model_state=True),
                        world_size))
    if cfg.untied and cfg.head_chunk:
        args = model_args(cfg)
        sp, ring, _ = check_layout(cfg, world_size, args)
        ulysses_size = sp // ring
        chunks = sorted(untied_sp.valid_head_chunks(args, ulysses_size), reverse=True)
        changes += [(f"--head-chunk {chunk}", replace(cfg, head_chunk=chunk), world_size)
                    for chunk in chunks if chunk < cfg.head_chunk]
    if cfg.keep_attention:
        changes.append(("without --keep-attention", replace(cfg, keep_attention=False), world_size))
    changes += [(f"--gpus {world_size * k}", cfg, world_size * k) for k in (2, 4, 8, 16)
                if world_size * k <= gpus_per_node or world_size * k % gpus_per_node == 0]
    for change, candidate, gpus in changes:
        try:
            candidate, plan = plan_with_head_chunk(resolve_techniques(candidate), gpus, gpu_mem)
        except ValueError:  # not a setup these GPUs can run
            continue
        if all(plan_fits(plan, gpus, gpu_mem, host_mem, gpus_per_node)):
            return (f"{change} fits (peak {plan['peak'] / GiB:.1f} GiB per GPU, host "
                    f"{plan['host'] / GiB:.1f} GiB per GPU)")
    length, plan = plan_longest_seq_len(cfg, world_size, gpu_mem, host_mem,
                                        gpus_per_node=gpus_per_node)
    if plan is None:
        return "nothing fits with one change (with these flags not even sp x 1,024 tokens fit)"
    return (f"--seq-len {length // 1024}K, the longest that fits these flags (peak "
            f"{plan['peak'] / GiB:.1f} GiB per GPU)")


def plan_table(cfg: Config, world_size: int, gpu_mem: int, host_mem: int,
               gpus_per_node: int = GPUS_PER_NODE, gpu_name: str = DEFAULT_GPU) -> str:
    """The per-GPU table of `train.py --plan` for cfg.seq_len, with the head chunk a GPU run of
    these flags takes (plan_run's choice); what else it takes (kept attention outputs, the MLP
    tile) and its predicted step below; where it does not fit, the first change that would
    (what_would_fit)."""
    args, asked = model_args(cfg), cfg
    machine = Machine(world_size, gpu_name, gpu_mem, host_mem,
                      gpus_sharing_a_node(world_size, gpus_per_node))
    chosen = choose(asked, machine)[0]
    cfg = replace(asked, head_chunk=chosen.cfg.head_chunk)
    plan = plan_memory(cfg, world_size)
    gpu_fits, host_fits = plan_fits(plan, world_size, gpu_mem, host_mem, gpus_per_node)
    node = gpus_sharing_a_node(world_size, gpus_per_node)
    peak = plan["moments"][plan["peak_moment"]]
    gpus = gpus_text(world_size)
    row = lambda label, n: f"{label:<48}{n / GiB:9.1f}"  # noqa: E731
    some = cfg.checkpoint_layers is not None and cfg.checkpoint_layers < args.n_layers
    label_column = (2 if some else 0) if cfg.checkpoint else 1
    other = {PLAN_COMPONENTS[c][label_column] or PLAN_COMPONENTS[c][0]: peak.get(c, 0)
             for c in PLAN_COMPONENTS}
    lines = [
        f"{model_name(cfg)} ({model.num_params(args) / 1e9:.2f}B parameters): "
        f"{plan_tokens_text(cfg.seq_len)} tokens x batch {cfg.batch_size}, {cfg.dtype}; {gpus} "
        f"(data {plan['dp']} x sequence {plan['sp']}), {plan['local_tokens']:,} tokens per GPU",
        f"techniques: {techniques_text(cfg, plan['head_chunk'], plan['ring'])}",
        f"{'per GPU':<48}{'GiB':>9}",
        row("model state (params, grads, Adam) at the peak", peak["model_state"])
        + (f"   (all of it on the host: {plan['host_parts']['model state'] / GiB:.1f})"
           if cfg.offload_model_state else f"   (all of it: {plan['model_state'] / GiB:.1f})"),
        row("attention activations", peak.get("attention", 0)),
        row("other", sum(other.values())),
        "    " + "; ".join(f"{label} {n / GiB:.1f}" for label, n in other.items()),
        row("total at the peak", plan["peak"]) + f"   {gpu_fit_text(plan['peak'], gpu_mem)}",
        f"    peak: {plan_peak_text(plan)}",
        row("host RAM per GPU", plan["host"])
        + f"   {'fits' if host_fits else 'does NOT fit'} in {host_mem / node / GiB:.1f} "
        f"({host_mem / GiB:.1f} per node / {gpus_text(node)} per node)",
        "    " + "; ".join(f"{'offloaded checkpoints' if part == 'checkpoints' else part} "
                           f"{n / GiB:.1f}" for part, n in plan["host_parts"].items()),
        "other moments: " + ", ".join(f"{m} {sum(c.values()) / GiB:.1f}" for m, c
                                      in plan["moments"].items() if m != plan["peak_moment"]),
    ]
    if chosen.fits and chosen.cfg.keep_attention and asked.keep_attention is None:
        lines.append(f"--keep-attention fits too (GPU {chosen.plan['peak'] / GiB:.1f}, host "
                     f"{chosen.plan['host'] / GiB:.1f} per GPU): the recompute skips "
                     f"attention's forward, ~1.2x faster steps at long lengths "
                     f"(docs/training.md); a GPU run turns it on")
    if chosen.fits and chosen.cfg.mlp_tile_tokens and asked.mlp_tile_tokens is None:
        lines.append(f"a GPU run tiles the MLP {chosen.cfg.mlp_tile_tokens:,} tokens at a time "
                     f"(--mlp-tile-tokens): peak {chosen.plan['peak'] / GiB:.1f} GiB")
    if chosen.fits and chosen.seconds is not None:
        lines.append(f"a GPU run of these flags: {flags_text(chosen.cfg)}, "
                     f"{candidate_text(chosen, machine)}")
        lines += disagreement_lines(asked, machine, chosen)
    elif chosen.fits:
        lines.append(f"no step time predicted: no speed rates for {gpu_name!r} (--gpu; "
                     f"support/step_time.py has {', '.join(step_time.GPU_RATES)})")
    if not (gpu_fits and host_fits):
        lines.append("to fit: "
                     + what_would_fit(asked, world_size, gpu_mem, host_mem, gpus_per_node))
    if cfg.documents:
        lines.append(DOCUMENTS_NOTE)
    return "\n".join(lines)


def plan_forward_table(cfg: Config, world_size: int, gpu_mem: int) -> str:
    """The per-GPU table of `plan.py --eval`: one evaluation forward at cfg.seq_len."""
    args = model_args(cfg)
    cfg, plan = plan_with_head_chunk(cfg, world_size, gpu_mem, forward_only=True)
    peak = plan["moments"][plan["peak_moment"]]
    row = lambda label, n: f"{label:<48}{n / GiB:9.1f}"  # noqa: E731
    return "\n".join([
        f"{model_name(cfg)} ({model.num_params(args) / 1e9:.2f}B parameters): evaluation forward "
        f"(no gradients) at {plan_tokens_text(cfg.seq_len)} tokens x batch {cfg.batch_size}, "
        f"{cfg.dtype}; {gpus_text(world_size)} (data {plan['dp']} x sequence {plan['sp']}), "
        f"{plan['local_tokens']:,} tokens per GPU",
        "techniques: " + techniques_text(replace(cfg, checkpoint=False, offload=False),
                                         plan["head_chunk"], plan["ring"]),
        f"{'per GPU':<48}{'GiB':>9}",
        row("parameters (no gradients, no optimizer state)", peak["model_state"]),
        row("FSDP gathered params (root + 2 blocks)", peak["fsdp"]),
        row("residual stream of the running block", peak["saved"]),
        row("attention temporaries", peak.get("attention", 0)),
        row("MLP / norm / loss temporaries", peak.get("block", 0) + peak.get("loss", 0)),
        row("total at the peak", plan["peak"]) + f"   {gpu_fit_text(plan['peak'], gpu_mem)}",
        f"    peak: {plan['peak_moment']}",
        "other moments: " + ", ".join(f"{m} {sum(c.values()) / GiB:.1f}" for m, c
                                      in plan["moments"].items() if m != plan["peak_moment"]),
    ])


def plan_levels(cfg: Config):
    """(label, config) for each stack level 0..5, with Untied Ulysses next to Ulysses at levels 2
    and 3 (level 5 is level 4 with it), and level 4 without sequence parallelism (--sp 1); cfg's
    other flags (batch size, head chunk, --sp, --checkpoint-layers, tile sizes, --tile-norm,
    dtype) kept where the level has their technique."""
    techniques = {flag: False for flag, _ in TECHNIQUES}
    base = replace(cfg, stack=None, sp=None, head_chunk=None, checkpoint_layers=None,
                   **techniques)
    rows = []
    for level in range(MAX_STACK + 1):
        for use_untied in ((False, True) if level in (2, 3) else (level == 5,)):
            label = f"--stack {level}" + (" --untied" if use_untied and level < 5 else "")
            rows.append((label, replace(base, stack=level, untied=use_untied,
                                        sp=cfg.sp if level >= 2 else None,
                                        ring=cfg.ring if level >= 2 else None,
                                        head_chunk=cfg.head_chunk if use_untied else None,
                                        checkpoint_layers=cfg.checkpoint_layers
                                        if level >= 3 else None)))
    rows.append(("--stack 4 --sp 1 (no context parallelism)",
                 replace(base, stack=4, sp=1, ring=None, checkpoint_layers=cfg.checkpoint_layers)))
    return rows


def best_ring(cfg: Config, world_size: int, gpu_mem: int, host_mem: int,
              gpus_per_node: int = GPUS_PER_NODE):
    """(length, plan, R) for the ring degree R > 1 (06: Ulysses P/R x ring R) with the longest
    length that fits, or None. A larger R leaves each GPU S/R tokens of fewer heads in the
    attention, so memory favours it; speed favours Ulysses inside a node (docs/ring.md)."""
    sp = cfg.sp or world_size
    best = None
    for ring in (r for r in range(2, sp + 1) if sp % r == 0):
        try:
            length, plan = plan_longest_seq_len(resolve_techniques(replace(cfg, ring=ring)),
                                                world_size, gpu_mem, host_mem,
                                                gpus_per_node=gpus_per_node)
        except ValueError:  # heads or lengths this ring cannot split
            continue
        if plan is not None and (best is None or length > best[0]):
            best = (length, plan, ring)
    return best


def plan_longest_table(cfg: Config, world_size: int, gpu_mem: int, host_mem: int,
                       gpus_per_node: int = GPUS_PER_NODE, forward_only: bool = False) -> str:
    """The table of `plan.py --seq-len max`: the longest length per stack level that fits with
    the margin, and what stops it (the GPU's memory or the host's). Levels that give the same
    answer share a row (on one GPU Ulysses has nothing to split). forward_only: the longest
    evaluation forward (eval.py), next to the longest training step."""
    node = gpus_sharing_a_node(world_size, gpus_per_node)
    # Flags of no level, kept in every row (plan_levels): named once, in the header.
    every_row_flags = ((" --offload-model-state" if cfg.offload_model_state else "")
                       + (" --tile-norm" if cfg.tile_norm else ""))
    what = "evaluation forward" if forward_only else "sequence"
    rows, model_state = {}, {}  # a row's answer -> the flags that give it; level -> its state
    n_heads, stack_4_length = model_args(cfg).n_heads, None
    for level_label, level_cfg in plan_levels(cfg):
        label = level_label
        try:
            level_cfg = resolve_techniques(level_cfg)
            length, plan = plan_longest_seq_len(level_cfg, world_size, gpu_mem, host_mem,
                                                gpus_per_node=gpus_per_node,
                                                forward_only=forward_only)
        except ValueError as error:
            cannot = f"{'-':>3}  cannot run on {gpus_text(world_size)}: {error}"
            rows.setdefault(cannot, []).append(label)
            continue
        if plan is None:
            rows.setdefault(f"{'':>3}  none fits (not even sp x 1,024 tokens)", []).append(label)
            continue
        if label in ("--stack 0", "--stack 1"):  # the one-GPU note below
            model_state[label] = plan["model_state"]
        if forward_only:
            trained = plan_longest_seq_len(level_cfg, world_size, gpu_mem, host_mem,
                                           gpus_per_node=gpus_per_node)[0]
            answer = (f"{plan['sp']:>3}  {plan_tokens_text(length):<22}{plan['peak'] / GiB:>9.1f}  "
                      f"{plan_tokens_text(trained):<22}  {plan['peak_moment']}")
        else:
            answer = (f"{plan['sp']:>3}  {plan_tokens_text(length):<22}{plan['peak'] / GiB:>9.1f}"
                      f"{plan['host'] / GiB:>13.1f}  {plan['limit']:<6} {plan_peak_text(plan)}")
            stack_4_length = length if label == "--stack 4" else stack_4_length
            if (label == "--stack 5" and plan["head_chunk"] == n_heads
                    and length < (stack_4_length or 0)):
                answer += (f"; U = all {n_heads} heads is one stage, which holds more than "
                           f"Ulysses (05 saves memory with several stages: more heads than GPUs)")
            label = label.replace("--stack 5", f"--stack 5 (U={plan['head_chunk']})")
        if plan["ring"] > 1 and cfg.ring is None:  # more GPUs than heads: 06's ring, the least
            label = (label.replace(" (U=", f" (R={plan['ring']}, U=") if " (U=" in label
                     else f"{label} (R={plan['ring']})")
        rows.setdefault(answer, []).append(label)
        if (label.startswith(("--stack 4", "--stack 5")) and "--sp 1" not in label
                and cfg.ring is None and not forward_only):
            ringed = best_ring(level_cfg, world_size, gpu_mem, host_mem, gpus_per_node)
            if ringed is not None and ringed[0] > length:  # 06 reaches further: its own row
                ring_length, ring_plan, ring = ringed
                ring_label = level_label + f" --ring {ring}" + (
                    f" (U={ring_plan['head_chunk']})" if ring_plan["head_chunk"] else "")
                rows.setdefault(f"{ring_plan['sp']:>3}  {plan_tokens_text(ring_length):<22}"
                                f"{ring_plan['peak'] / GiB:>9.1f}{ring_plan['host'] / GiB:>13.1f}  "
                                f"{ring_plan['limit']:<6} {plan_peak_text(ring_plan)}",
                                []).append(ring_label)
    rows = list(rows.items())
    if world_size == 1 and model_state.get("--stack 1", 0) > model_state.get("--stack 0", 2**62):
        i = next(i for i, (_, labels) in enumerate(rows) if "--stack 1" in labels)
        rows[i] = (rows[i][0] + f"; FSDP shards nothing on 1 GPU and keeps its state in fp32: "
                   f"{model_state['--stack 1'] / GiB:.1f} GiB (--stack 0: "
                   f"{model_state['--stack 0'] / GiB:.1f} in {cfg.dtype})", rows[i][1])
    rows = [(answer, ", ".join(labels)) for answer, labels in rows]
    if forward_only:
        rows = [(answer, labels.replace("--stack 3", "--stack 3 (no 03 in eval)", 1))
                for answer, labels in rows]
    width = max([44] + [len(labels) + 1 for _, labels in rows])
    header = [f"longest {what} that fits: {model_name(cfg)}, {gpus_text(world_size)} x "
              f"{gpu_mem / GiB:.1f} GiB ({(gpu_mem - PLAN_GPU_RESERVE) / GiB:.1f} usable) with "
              f"{margin_text()}, host {host_mem / GiB:.1f} GiB per node of {gpus_text(node)}, "
              f"{cfg.dtype}, batch {cfg.batch_size}; lengths are multiples of sp x 1,024 tokens"
              + (f"; every row{every_row_flags}" if every_row_flags else ""),
              f"{'flags':<{width}}{'sp':>3}  {'longest (tokens)':<22}{'peak GiB':>9}"
              + (f"  {'training (tokens)':<22}" if forward_only
                 else f"{'host GiB/GPU':>13}  {'limit':<6}") + " peak at"]
    return "\n".join(header + [f"{labels:<{width}}{answer}" for answer, labels in rows])


def plan_scaling_table(cfg: Config, gpu_counts: list, gpu_mem: int, host_mem: int,
                       gpus_per_node: int = GPUS_PER_NODE) -> str:
    """The table of `--seq-len max --scaling`: the longest length of cfg's techniques on each
    GPU count, with the model state on the GPUs and on the host (--offload-model-state). Nodes
    of `gpus_per_node` GPUs, each with `host_mem`. Each row takes the ring degree R (06: Ulysses
    P/R x ring R) that reaches furthest, R = 1 (Ulysses alone) when nothing beats it; with
    --ring given, that one."""
    techniques = techniques_text(replace(cfg, offload_model_state=False), "P")
    lines = [f"longest sequence per GPU count: {model_name(cfg)}, {techniques}; GPUs of "
             f"{gpu_mem / GiB:.1f} GiB ({(gpu_mem - PLAN_GPU_RESERVE) / GiB:.1f} usable) with "
             f"{margin_text()}, nodes of {gpus_text(gpus_per_node)} with {host_mem / GiB:.1f} GiB "
             f"host memory each; Ulysses x ring: the ring degree that reaches furthest (06)",
             f"{'GPUs':>5}{'nodes':>6}  {'model state':<12}{'ulysses x ring x dp':>20}  "
             f"{'longest (tokens)':<22}{'peak GiB':>9}{'host GiB/GPU':>13}  {'limit':<6}"]
    for gpus in gpu_counts:
        nodes = -(-gpus // gpus_per_node)
        for on_host in (False, True):
            row_cfg = replace(cfg, offload_model_state=on_host)
            where = "host" if on_host else "GPU"
            start = f"{gpus:>5}{nodes:>6}  {where:<12}"
            try:
                length, plan = plan_longest_seq_len(row_cfg, gpus, gpu_mem, host_mem,
                                                    gpus_per_node=gpus_per_node)
            except ValueError as error:
                length, plan, error_text = 0, None, f"impossible: {error}"
            else:
                error_text = "none fits"
            if cfg.ring is None and (row_cfg.ulysses or row_cfg.untied):
                ringed = best_ring(row_cfg, gpus, gpu_mem, host_mem, gpus_per_node)
                if ringed is not None and ringed[0] > length:
                    length, plan, _ = ringed
            if plan is None:
                lines.append(f"{start}{error_text}")
                continue
            layout = f"{plan['sp'] // plan['ring']} x {plan['ring']} x {plan['dp']}"
            lines.append(f"{start}{layout:>20}  {plan_tokens_text(length):<22}"
                         f"{plan['peak'] / GiB:>9.1f}{plan['host'] / GiB:>13.1f}  "
                         f"{plan['limit']:<6}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# What a GPU run takes: every choice in one call (train.py applies it; --stack auto ranks them)
# ---------------------------------------------------------------------------------------------

# The kept attention outputs the plan turns on for speed (--keep-attention left open) must fit,
# with everything else on the host, in this share of the host memory it plans with: a run reads
# what the host can hand out when it starts and needs some for itself besides. What a run must
# offload to fit (03's checkpoints, 01's model state: given, or taken by --stack auto) has to fit
# the whole, as host_memory_error holds every run to.
HOST_HEADROOM = 0.9
# 08 left open is taken where it is predicted to take this share of the step off or more: its
# measured gains, 0.3-0.9% on one H100 (docs/results.md), are about one step's own spread.
OVERLAP_MIN_GAIN = 0.005
# 09 left open, where a plan without it fits: taken where predicted this share faster or more.
# Measured on one H100 (Llama-3.2-3B, cuDNN): 1.4% faster at 32K (predicted 2.3%), 3.1% at 64K
# (predicted 1.3%); it also page-locks the blocks' moments on the host (a slower first step).
MOMENTS_MIN_GAIN = 0.01
# The Config fields a run's choice sets (RunChoice.settings).
SETTINGS = ("fsdp", "ulysses", "untied", "sp", "ring", "checkpoint", "offload", "checkpoint_layers",
            "keep_attention", "tile_mlp", "tile_loss", "mlp_tile_tokens", "head_chunk",
            "offload_model_state", "offload_activations", "overlap_optimizer", "offload_moments")


@dataclass
class Candidate:
    """One configuration the planner weighed: its Config, memory plan, predicted step time
    (None: no speed rates for this GPU) and whether it fits GPU and host."""
    cfg: Config
    plan: dict
    seconds: float | None
    fits: bool
    why: str = ""  # where --stack auto took 09 of its own: why (choose)


@dataclass
class RunChoice:
    """Every choice the plan makes for one run: train.py applies `settings` (Config fields) and
    prints `lines`. `ranking`: the fastest candidate of each set of techniques, fastest first
    (those that fit first); `chosen` is the one the settings describe (None on the CPU)."""
    settings: dict
    lines: list
    chosen: Candidate | None = None
    ranking: list = field(default_factory=list)
    expected: dict | None = None  # what the run's closing line holds it to (expected_of)


def plan_run(cfg: Config, machine: Machine | None) -> RunChoice:
    """What a run of `cfg` on `machine` (support/runtime.py's read_machine; None on the CPU,
    where nothing is planned) takes, in one value: with --stack auto the fastest configuration
    that fits (techniques and their settings, the flags given kept), else the fastest settings
    that fit among those the flags leave open (Untied Ulysses' U, --keep-attention, 04's MLP
    tile); the lines the run prints about it (with a line where the planner would run other
    techniques than the flags given); and the host-memory check. A ValueError, before anything
    is built: an impossible layout, flags that contradict each other, --stack auto with nothing
    that fits, host memory the chosen plan overfills (host_memory_error)."""
    if machine is None:
        if cfg.stack == config.AUTO:
            raise ValueError("--stack auto plans for GPUs (their memory and speed): on the CPU "
                             "give the techniques, --stack 0-5 (python plan.py ... --stack auto "
                             "shows what a GPU run takes)")
        return RunChoice({}, [])
    chosen, ranking = choose(cfg, machine)
    error = host_memory_error(chosen.cfg, machine.gpus, machine.gpus_per_node, machine.host_mem)
    if error:
        raise ValueError(error)
    settings = {name: getattr(chosen.cfg, name) for name in SETTINGS
                if getattr(chosen.cfg, name) != getattr(cfg, name)}
    best = best_per_techniques(ranking)
    lines = (choice_lines(cfg, machine, chosen, best, settings)
             + disagreement_lines(cfg, machine, chosen)
             + one_sequence_a_gpu_lines(cfg, machine, chosen))
    return RunChoice(settings, lines, chosen, best, expected_of(chosen, machine))


def expected_of(chosen: Candidate, machine: Machine) -> dict:
    """What the run should measure, for its closing line to hold it to: the predicted step
    (None without speed rates), the planned peak (GiB), the allocator retries a step the plan
    priced (step_time.predicted_retries), and what leaves more memory free where there are
    more: a further checkpointed block, where some are not."""
    cfg, args = chosen.cfg, model_args(chosen.cfg)
    retries = step_time.predicted_retries(cfg, args, machine.gpus,
                                          free_at_peak(chosen.plan["peak"], machine.gpu_mem))
    checkpointed = config.checkpointed_layers(cfg, args.n_layers)
    more_free = (f"--checkpoint-layers {checkpointed + 1}"
                 if cfg.checkpoint and checkpointed < args.n_layers else None)
    return {"step_s": chosen.seconds, "peak_gib": chosen.plan["peak"] / GiB,
            "retries_per_step": retries, "more_free": more_free}


def one_sequence_a_gpu_lines(cfg: Config, machine: Machine, chosen: Candidate) -> list:
    """Where --sp was left open on several GPUs (one sequence over all of them) and one
    sequence a GPU (--sp 1: as many a step as GPUs) is predicted at least SP1_HINT_GAIN more
    tokens/s per GPU, a line that says so. The planner never takes it: --sp sets how many
    sequences a step trains (the batch), which is the user's to give. A short sequence split
    over many GPUs leaves each a small share of work beside the same per-step costs (Llama-3-8B
    at 16K over 8 GPUs: 2K tokens a GPU). Not on a resumed run (its saved state fixes the
    layout), nor where the flags given (--ulysses, --ring) allow no plan of one sequence a GPU."""
    if (machine.gpus == 1 or cfg.sp is not None or cfg.resume or chosen.seconds is None
            or not chosen.fits or chosen.plan["dp"] == machine.gpus):
        return []
    try:
        alone, _ = choose(replace(cfg, sp=1), machine)
    except ValueError:  # no plan of one sequence a GPU fits (or the flags forbid one)
        return []
    if not alone.fits or alone.seconds is None:
        return []
    ours, theirs = (tokens_per_s_per_gpu(c, machine) for c in (chosen, alone))
    if theirs < ours * (1 + SP1_HINT_GAIN):
        return []
    # without a sequence-parallel technique every GPU has its own sequence: no --sp to give
    flags = flags_text(alone.cfg) + (" --sp 1" if alone.cfg.ulysses or alone.cfg.untied else "")
    sequences = alone.plan["dp"] * cfg.batch_size * cfg.grad_accum
    return [f"  one sequence a GPU ({flags}) would train {sequences} sequences a step: "
            f"predicted {theirs:,.0f} tokens/s per GPU, {theirs / ours - 1:.0%} more than this "
            f"layout's {ours:,.0f}. How many sequences a step trains is yours to give, so the "
            f"planner does not take it (python plan.py with these flags shows the plan)"]


def disagreement_lines(cfg: Config, machine: Machine, chosen: Candidate) -> list:
    """Where technique flags were given (with or without --stack auto) and the speed model
    would run other techniques, a line that says so: the flags win, never silently."""
    constrained = cfg.stack != config.AUTO or config.techniques_given(replace(cfg, stack=None))
    if not (constrained and chosen.fits and chosen.seconds is not None):
        return []
    try:
        fastest = choose(unconstrained(cfg), machine)[0]
    except ValueError:  # nothing fits without the flags: they are needed
        return []
    # (auto weighs FSDP plans only: flags without FSDP can be faster than all it weighs)
    if techniques_of(fastest.cfg) == techniques_of(chosen.cfg) or fastest.seconds >= chosen.seconds:
        return []
    return [f"the planner's fastest plan that fits is {flags_text(fastest.cfg)} (predicted "
            f"{fastest.seconds:.2f} s a step against {chosen.seconds:.2f} with the flags given, "
            f"which win): --stack auto alone takes it"]


def choose(cfg: Config, machine: Machine) -> tuple:
    """(the chosen Candidate, the ranking): the first that fits, by predicted step time where
    the GPU has speed rates (support/step_time.py), else in memory_order: the memory-only
    choice. --stack auto with 09 left open, on a known host, takes it where nothing fits
    without it, or where it is predicted MOMENTS_MIN_GAIN faster than the fastest without it
    (the candidate's `why` says which; weighed only where that plan pays for memory). None
    fitting: --stack auto stops (nothing_fits_text); given flags run as given, their open
    settings at the least memory."""
    rates = step_time.rates_for(machine.gpu_name)
    ranking = rank_candidates(cfg, machine, rates)
    best = ranking[0]
    if (cfg.stack == config.AUTO and moments_left_open(cfg) and machine.host_mem is not None
            and (not best.fits or pays_for_memory(best.cfg))):
        streamed = rank_with_moments_on_host(cfg, machine, rates)
        gain = moments_gain(streamed[0], best)
        if streamed[0].fits and (not best.fits or gain):
            why = ("without it nothing fits" if not best.fits else
                   f"predicted to take {gain:.1%} off the step of the fastest without it, "
                   f"{flags_text(best.cfg)}: {best.seconds:.2f} s")
            # one ranking of both (plan.py shows it whole), the plan with 09 first
            both = sorted(streamed[1:] + ranking, key=ranking_order)
            return replace(streamed[0], why=why), [streamed[0], *both]
    if best.fits:
        return best, ranking
    if cfg.stack == config.AUTO:
        raise ValueError(nothing_fits_text(cfg, machine))
    return min(ranking, key=lambda c: (c.plan["peak"], memory_order(c.cfg))), ranking


def with_moments_on_host(cfg: Config) -> Config:
    """cfg with 09 (the blocks' moments on the host), which runs 08's updates."""
    return replace(cfg, offload_moments=True, overlap_optimizer=True)


def rank_with_moments_on_host(cfg: Config, machine: Machine, rates) -> list:
    return rank_candidates(with_moments_on_host(cfg), machine, rates)


def pays_for_memory(cfg: Config) -> bool:
    """Whether a plan runs work only for memory (recompute, tiles, stages, the state or
    activations on the host): where none, the GPU room 09 frees has nothing to buy."""
    return bool(cfg.checkpoint or cfg.tile_mlp or cfg.tile_loss or cfg.untied
                or cfg.offload_model_state or cfg.offload_activations)


def moments_gain(streamed: Candidate, best: Candidate) -> float:
    """The share of `best`'s predicted step that 09's plan takes off, where it is
    MOMENTS_MIN_GAIN or more (else 0.0; 0.0 where either has no prediction)."""
    if streamed.seconds is None or best.seconds is None:
        return 0.0
    gain = 1 - streamed.seconds / best.seconds
    return gain if gain >= MOMENTS_MIN_GAIN else 0.0


def rank_candidates(cfg: Config, machine: Machine, rates) -> list:
    """Every candidate of `cfg` (candidate_configs) planned, predicted and held to fits; those
    that fit first, fastest first, ties (and every candidate, without rates) in memory_order.
    An impossible layout: the ValueError of the first candidate tried."""
    kernel = planned_kernel(cfg)
    rates = rates if rates and kernel in rates.attention else None

    def predicted(candidate, plan):
        free = free_at_peak(plan["peak"], machine.gpu_mem)
        block = plan["host_parts"]["activations (07)"] // max(candidate.offload_activations, 1)
        return (step_time.step_seconds_total(candidate, machine.gpus, rates, kernel,
                                             free_at_peak=free, offloaded_block_bytes=block)
                if rates else None)

    ranked, first_error = [], None
    for candidate in candidate_configs(cfg, machine.gpus):
        try:
            plan = plan_memory(candidate, machine.gpus)
        except ValueError as error:
            first_error = first_error or error
            continue
        seconds = predicted(candidate, plan)
        if (candidate.overlap_optimizer and not candidate.offload_moments
                and cfg.overlap_optimizer is None and seconds
                and seconds > (1 - OVERLAP_MIN_GAIN) * predicted(
                    replace(candidate, overlap_optimizer=False), plan)):
            continue  # 08 left open, and too little to gain: AdamW at once
        fits = candidate_fits(plan, candidate, cfg, machine)
        ranked.append(Candidate(candidate, plan, seconds, fits))
        if fits and candidate.checkpoint and cfg.checkpoint_layers is None:
            # 03's k of L blocks checkpointed, left open: the fewest that fit (each block left
            # out skips its recompute; fewer offloaded, so the host holds less too), and with
            # speed rates the fewest that also leave free what FSDP2's reduce-scatter stream
            # keeps cached (the allocator then retries never: step_time.predicted_retries)
            args = model_args(candidate)
            retry_free = step_time.allocator_headroom(candidate, args, machine.gpus)
            headrooms = [0] + ([retry_free] if rates and retry_free is not None else [])
            for k in sorted({fewest_checkpointed_layers_that_fit(
                    candidate, machine.gpus, machine.gpu_mem, headroom) for headroom in headrooms}):
                if k < args.n_layers:
                    fewer = replace(candidate, checkpoint_layers=k)
                    fewer_plan = plan_memory(fewer, machine.gpus)
                    ranked.append(Candidate(fewer, fewer_plan, predicted(fewer, fewer_plan), True))
    if not ranked:
        raise first_error or ValueError("no configuration to plan")
    return sorted(ranked, key=ranking_order)


def ranking_order(candidate: Candidate) -> tuple:
    """Those that fit first, fastest first, ties (every candidate, without rates) in
    memory_order."""
    return not candidate.fits, candidate.seconds or 0, memory_order(candidate.cfg)


def candidate_configs(cfg: Config, world_size: int) -> list:
    """The configurations the planner weighs for `cfg`: under --stack auto every combination
    of the techniques (always FSDP, 01's fp32 master state: --stack 0 trains bf16 weights, so it
    is never chosen for you) with the flags given kept on, and for each the settings they
    leave open: U, --keep-attention, the MLP tile (04's default, or the largest tiles of 32K,
    16K and 8K tokens, cut evenly). The sequence-parallel degree stays what the flags make it
    (all GPUs, or --sp): every candidate trains the same tokens per step."""
    techniques = auto_techniques(cfg, world_size) if cfg.stack == config.AUTO else [cfg]
    args = model_args(cfg)
    candidates = []
    for chosen in techniques:
        try:
            sp, ring, _ = check_layout(replace(chosen, head_chunk=None), world_size, args)
        except ValueError:
            candidates.append(chosen)  # plan_memory names why
            continue
        local_tokens = chosen.batch_size * chosen.seq_len // sp
        chunks = ([chosen.head_chunk] if chosen.head_chunk or not chosen.untied
                  else untied_sp.valid_head_chunks(args, sp // ring))
        tiles = ([chosen.mlp_tile_tokens] if chosen.mlp_tile_tokens or not chosen.tile_mlp
                 else [None, *{tiling.even_tile_tokens(local_tokens, min(t, local_tokens))
                               for t in MLP_TILE_CHOICES if min(t, local_tokens) > args.dim}])
        kept = ([chosen.keep_attention] if chosen.keep_attention is not None
                or not chosen.checkpoint else [False, True])
        # 08 where FSDP's units run AdamW on the GPU (with the state on the host it runs on the
        # host's cores; without FSDP no GPU has run it); 09 (which implies 08) where given
        # (left open, choose() weighs it after the plans without it)
        behind = ([bool(chosen.overlap_optimizer or chosen.offload_moments)]
                  if chosen.overlap_optimizer is not None or chosen.offload_moments
                  or chosen.offload_model_state or not chosen.fsdp else [False, True])
        # 03's checkpointed blocks k, where left open, join in rank_candidates: the fewest
        # that fit need each candidate's plan. With 07's blocks above them, at most L - 2N.
        layers = chosen.checkpoint_layers
        if chosen.checkpoint and chosen.offload_activations and layers is None:
            layers = args.n_layers - 2 * chosen.offload_activations
        candidates += [replace(chosen, head_chunk=chunk, mlp_tile_tokens=tile, keep_attention=keep,
                               checkpoint_layers=layers, overlap_optimizer=overlap)
                       for chunk, tile, keep, overlap in product(chunks, tiles, kept, behind)]
    return candidates


def auto_techniques(cfg: Config, world_size: int) -> list:
    """--stack auto's sets of techniques, before their settings: each technique off or on
    unless a flag given turns it on (--head-chunk asks for 05, --ring for sequence parallelism,
    --keep-attention and --checkpoint-layers for 03, the tile sizes for their tiles). On one
    GPU (or --sp 1) the attention is the model's own or 05's stages; on more, 02 or 05 over all
    of them (or --sp), with 06's ring over each R that divides P. Contradicting flags: a
    ValueError."""
    if cfg.head_chunk is not None and cfg.ulysses:
        raise ValueError("--head-chunk is a setting of --untied (05), and --ulysses (02) is its "
                         "alternative: give one of them with --stack auto")
    if cfg.ring not in (None, 1) and cfg.sp == 1:
        raise ValueError(f"--ring {cfg.ring} splits the sequence over ranks, and --sp 1 splits "
                         f"it over none: give one of them with --stack auto")
    sp = cfg.sp or world_size
    ring_options = [cfg.ring] if cfg.ring else [r for r in range(1, sp + 1) if sp % r == 0]
    seams = ([("ulysses", r) for r in ring_options] + [("untied", r) for r in ring_options]
             if sp > 1 or cfg.ring else [("none", None), ("untied", None)])
    if cfg.ulysses or cfg.untied or cfg.head_chunk is not None:
        seams = [(s, r) for s, r in seams if s == ("untied" if cfg.untied or cfg.head_chunk
                                                   else "ulysses")]
    on = lambda given: [True] if given else [False, True]  # noqa: E731
    checkpointing = ([(True, True)] if cfg.offload else
                     [(True, False), (True, True)]
                     if cfg.checkpoint or cfg.keep_attention or cfg.checkpoint_layers
                     else [(False, False), (True, False), (True, True)])
    return [replace(cfg, fsdp=True, ulysses=seam == "ulysses", untied=seam == "untied",
                    sp=cfg.sp if seam != "none" else None, ring=ring, checkpoint=checkpoint,
                    offload=offload, tile_mlp=tile_mlp, tile_loss=tile_loss,
                    offload_model_state=on_host)
            for (seam, ring), (checkpoint, offload), tile_mlp, tile_loss, on_host in product(
                seams, checkpointing, on(cfg.tile_mlp or cfg.mlp_tile_tokens),
                on(cfg.tile_loss or cfg.loss_tile_tokens),
                # 08 steps AdamW on the GPU: its state stays there
                [False] if cfg.overlap_optimizer else on(cfg.offload_model_state))]


def unconstrained(cfg: Config) -> Config:
    """cfg with no technique flag, each of config.TECHNIQUE_FIELDS at its default: what
    --stack auto alone would weigh (the layout kept)."""
    defaults = {f.name: f.default for f in fields(Config) if f.name in config.TECHNIQUE_FIELDS}
    return replace(cfg, **{**defaults, "stack": config.AUTO})


def candidate_fits(plan: dict, candidate: Config, cfg: Config, machine: Machine) -> bool:
    """plan_fits on the machine; with kept attention outputs the planner turned on, within
    HOST_HEADROOM of the host; an unknown host takes nothing the planner would add there (kept
    outputs, offload, the model state beyond the flags given)."""
    kept_for_speed = candidate.keep_attention and cfg.keep_attention is None
    if machine.host_mem is None:
        adds_to_host = (kept_for_speed or (candidate.offload and not cfg.offload)
                        or (candidate.offload_model_state and not cfg.offload_model_state)
                        or (candidate.offload_moments and not cfg.offload_moments))
        host_mem = 0 if adds_to_host else 2**62
    else:
        host_mem = machine.host_mem * (HOST_HEADROOM if kept_for_speed else 1)
    return all(plan_fits(plan, machine.gpus, machine.gpu_mem, host_mem, machine.gpus_per_node))


def memory_order(cfg: Config) -> tuple:
    """The memory-only order (a GPU without speed rates; ties): the fewest techniques in the
    files' order (the model state on the host last, then the ring, 05, 04, 03), then the
    fewest stages, kept attention outputs, the largest MLP tile, the fewest checkpointed
    blocks, AdamW at once (08 off); Adam's moments on the GPU (09 off) first of all."""
    return (bool(cfg.offload_moments), cfg.offload_model_state, (cfg.ring or 1) > 1, cfg.untied,
            cfg.tile_mlp,
            cfg.tile_loss, cfg.offload, cfg.checkpoint, -(cfg.head_chunk or 0),
            not cfg.keep_attention, -(cfg.mlp_tile_tokens or 0), cfg.checkpoint_layers or 2**31,
            bool(cfg.overlap_optimizer))


def techniques_of(cfg: Config) -> tuple:
    """What sets a configuration's techniques apart (not their settings U, keep, MLP tile)."""
    return (cfg.fsdp, cfg.ulysses, cfg.untied, cfg.ring or 1, cfg.checkpoint, cfg.offload,
            cfg.tile_mlp, cfg.tile_loss, cfg.tile_norm, cfg.offload_model_state,
            bool(cfg.offload_moments))


def best_per_techniques(ranking: list) -> list:
    """The first (best) candidate of each set of techniques, in the ranking's order."""
    seen, best = set(), []
    for candidate in ranking:
        if techniques_of(candidate.cfg) not in seen:
            seen.add(techniques_of(candidate.cfg))
            best.append(candidate)
    return best


def flags_text(cfg: Config) -> str:
    """The flags that give cfg's techniques and settings: --stack N where its techniques are
    exactly a level's, else each technique's own flag."""
    on = {flag for flag, _ in TECHNIQUES if getattr(cfg, flag)}
    level = next((n for n in range(MAX_STACK, -1, -1) if level_techniques(n) == on), None)
    flags = ([f"--stack {level}"] if level is not None else
             ["--" + f.replace("_", "-") for f, _ in TECHNIQUES
              if f in on and not (f == "checkpoint" and cfg.offload)])
    flags += [f"--ring {cfg.ring}"] if (cfg.ring or 1) > 1 else []
    return " ".join(flags + settings_flags(cfg, ("checkpoint_layers", "head_chunk",
                                                 "keep_attention", "mlp_tile_tokens"))
                    + (["--tile-norm"] if cfg.tile_norm else [])
                    + (["--offload-model-state"] if cfg.offload_model_state else [])
                    + ([f"--offload-activations {cfg.offload_activations}"]
                       if cfg.offload_activations else [])
                    + (["--overlap-optimizer"] if cfg.overlap_optimizer
                       and not cfg.offload_moments else [])
                    + (["--offload-moments"] if cfg.offload_moments else []))


def level_techniques(level: int) -> set:
    """The techniques --stack `level` turns on (05 in place of 02 at 5)."""
    on = {flag for flag, first in TECHNIQUES if first <= level}
    return on - {"ulysses"} if "untied" in on else on


def settings_flags(cfg: Config, names) -> list:
    """The flags of cfg's settings among `names` (03's checkpointed blocks and
    --keep-attention, 05's U, 04's MLP tile, 08), where its techniques have them."""
    flags = []
    if "checkpoint_layers" in names and cfg.checkpoint and cfg.checkpoint_layers:
        flags.append(f"--checkpoint-layers {cfg.checkpoint_layers}")
    if "head_chunk" in names and cfg.untied and cfg.head_chunk:
        flags.append(f"--head-chunk {cfg.head_chunk}")
    if "keep_attention" in names and cfg.checkpoint:
        flags.append("--keep-attention" if cfg.keep_attention else "--no-keep-attention")
    if "mlp_tile_tokens" in names and cfg.tile_mlp and cfg.mlp_tile_tokens:
        flags.append(f"--mlp-tile-tokens {cfg.mlp_tile_tokens}")
    if "overlap_optimizer" in names and cfg.overlap_optimizer and not cfg.offload_moments:
        flags.append("--overlap-optimizer")  # (off: AdamW at once, as ever; 09 implies it)
    if "offload_moments" in names and cfg.offload_moments:
        flags.append("--offload-moments")
    return flags


def tokens_per_s_per_gpu(candidate: Candidate, machine: Machine) -> float:
    """A candidate's predicted throughput: the tokens of a step (every data-parallel group's
    sequences, every micro-batch) per GPU and second. Needs its predicted step."""
    cfg = candidate.cfg
    tokens = cfg.batch_size * cfg.seq_len * candidate.plan["dp"] * cfg.grad_accum
    return tokens / machine.gpus / candidate.seconds


def candidate_text(candidate: Candidate, machine: Machine) -> str:
    """A candidate's predicted step (where the GPU has rates), peak and host bytes."""
    plan, speed = candidate.plan, ""
    if candidate.seconds is not None:
        speed = (f"predicted {candidate.seconds:.2f} s a step "
                 f"({tokens_per_s_per_gpu(candidate, machine):,.0f} tokens/s per GPU), ")
    return (f"{speed}peak {plan['peak'] / GiB:.1f} GiB of {machine.gpu_mem / GiB:.1f} (fits "
            f"with the {PLAN_MARGIN:.1%} margin: {'yes' if candidate.fits else 'NO'}), host "
            f"{plan['host'] / GiB:.1f} GiB per GPU")


def choice_lines(cfg: Config, machine: Machine, chosen: Candidate, best: list,
                 settings: dict) -> list:
    """What a run prints first about the plan's choices: what it took and how, the predicted
    step and peak, the runner-up; for flags that do not fit, that they run as given."""
    how = ("the fastest that fits" if chosen.seconds is not None
           else f"the memory-only choice (no speed rates for {machine.gpu_name!r}; "
                f"support/step_time.py has {', '.join(step_time.GPU_RATES)}): the fewest "
                f"techniques that fit, in the files' order")
    if chosen.why:
        how += f" (09, Adam's moments on the host: {chosen.why})"
    if cfg.stack == config.AUTO:
        lines = [f"--stack auto: {flags_text(chosen.cfg)}, {how}: "
                 f"{candidate_text(chosen, machine)}"]
        ruled_out = moments_ruled_out_text(cfg, machine, chosen)
        if ruled_out:
            lines.append(f"  {ruled_out}")
        runner_up = next((c for c in best[1:] if c.fits), None)
        if runner_up is not None:
            lines.append(f"  runner-up: {flags_text(runner_up.cfg)}: "
                         f"{candidate_text(runner_up, machine)} (python plan.py with these "
                         f"flags ranks them all)")
        return lines
    if not chosen.fits:
        return [f"the plan of these flags does not fit: {candidate_text(chosen, machine)}; they "
                f"run as given, their open settings at the least memory (python plan.py with "
                f"the same flags says what would fit)"]
    chosen_flags = settings_flags(chosen.cfg, settings)
    if not chosen_flags:
        return []
    return [f"the plan's settings for these flags: {' '.join(chosen_flags)}, {how}: "
            f"{candidate_text(chosen, machine)}; give a flag to choose"]


def nothing_fits_text(cfg: Config, machine: Machine) -> str:
    """--stack auto and no configuration fits: the longest length that does (frugal_configs)
    and what stops longer ones; where the flags given ruled techniques out, that without them
    it fits; else the fewest more GPUs (2x, 4x, 8x) on which it fits."""
    lines = [f"--stack auto: nothing fits {model_name(cfg)} at {plan_tokens_text(cfg.seq_len)} "
             f"tokens on {gpus_text(machine.gpus)} of {machine.gpu_mem / GiB:.1f} GiB with the "
             f"{PLAN_MARGIN:.1%} margin (host {host_text(machine.host_mem)} per node)"]
    longest = None
    for candidate in frugal_configs(cfg, machine):
        try:
            found = plan_longest_seq_len(candidate, machine.gpus, machine.gpu_mem,
                                         machine.host_mem or 0,
                                         gpus_per_node=machine.gpus_per_node)
        except ValueError:
            continue
        if found[1] is not None and (longest is None or found[0] > longest[0]):
            longest = (*found, candidate)
    if longest is None:
        lines.append("not even sp x 1,024 tokens fit")
    else:
        length, plan, candidate = longest
        lines.append(f"the longest that fits is {length:,} tokens (--seq-len {length // 1024}K) "
                     f"with {flags_text(candidate)}, where longer ones run out of "
                     f"{plan['limit']} memory")
    ruled_out = moments_ruled_out_text(cfg, machine)
    lines += [ruled_out] if ruled_out else []
    if config.techniques_given(replace(cfg, stack=None)):
        try:
            free = choose(unconstrained(cfg), machine)[0]
        except ValueError:  # nothing fits without them either
            pass
        else:
            lines.append(f"without the technique flags given it fits: --stack auto alone takes "
                         f"{flags_text(free.cfg)}")
            return "; ".join(lines)
    if ruled_out:  # (more GPUs or not, the flag is what stands in the way here)
        return "; ".join(lines)
    for more in (2, 4, 8):
        bigger = replace(machine, gpus=machine.gpus * more,
                         gpus_per_node=min(machine.gpus * more, GPUS_PER_NODE))
        if any(fits_somehow(c, cfg, bigger) for c in frugal_configs(cfg, bigger)):
            lines.append(f"on {gpus_text(bigger.gpus)} it fits")
            break
    return "; ".join(lines)


def fits_somehow(candidate: Config, cfg: Config, machine: Machine) -> bool:
    try:
        return candidate_fits(plan_memory(candidate, machine.gpus), candidate, cfg, machine)
    except ValueError:  # a layout these GPUs cannot run
        return False


def frugal_configs(cfg: Config, machine: Machine) -> list:
    """--stack auto's least GPU memory per ring degree, the model state on the GPUs (with
    Adam's moments on the host too, 09, where it may run) or all of it on the host: every other
    technique on (05 where it may run, at its least-memory U), no kept attention outputs, 04's
    default tiles; on an unknown host nothing offloaded."""
    known = machine.host_mem is not None
    frugal = [c for c in auto_techniques(cfg, machine.gpus)
              if c.checkpoint and c.tile_mlp and c.tile_loss and c.offload == known
              and (known or not c.offload_model_state)]
    if any(c.untied for c in frugal):
        frugal = [c for c in frugal if c.untied]
    streamed = [with_moments_on_host(c) for c in frugal
                if known and not c.offload_model_state and moments_left_open(cfg)]
    return [replace(c, keep_attention=False) for c in frugal + streamed]


def moments_ruled_out_text(cfg: Config, machine: Machine,
                           chosen: Candidate | None = None) -> str | None:
    """Where a flag ruled 09 out (--no-offload-moments, --no-overlap-optimizer) and --stack auto
    took all the model state on the host (`chosen`) or nothing fits (None): what 09 would have
    given where it fits and is faster, and the flag that rules it out (the flag still wins)."""
    flags = [flag for flag, ruled in (("--no-offload-moments", cfg.offload_moments is False),
                                      ("--no-overlap-optimizer", cfg.overlap_optimizer is False))
             if ruled]
    if (not flags or cfg.offload_model_state or machine.host_mem is None
            or (chosen is not None and not chosen.cfg.offload_model_state)):
        return None
    streamed = rank_with_moments_on_host(cfg, machine, step_time.rates_for(machine.gpu_name))[0]
    if not streamed.fits or (chosen is not None and not moments_gain(streamed, chosen)):
        return None
    return (f"with 09 (Adam's moments on the host) {flags_text(streamed.cfg)} would fit: "
            f"{candidate_text(streamed, machine)}; {' and '.join(flags)} rule"
            f"{'s' if len(flags) == 1 else ''} it out")


def moments_left_open(cfg: Config) -> bool:
    """Whether --stack auto may still take 09 for cfg: no flag decided it (--offload-moments,
    --no-offload-moments), and none rules it out (--no-overlap-optimizer: 09 runs 08's
    updates; --offload-model-state: AdamW on the host's cores)."""
    return (cfg.offload_moments is None and cfg.overlap_optimizer is not False
            and not cfg.offload_model_state)


def host_text(host_mem: int | None) -> str:
    return "unknown" if host_mem is None else f"{host_mem / GiB:.1f} GiB"


def host_memory_error(cfg: Config, world: int, local_ranks: int,
                      available: int | None) -> str | None:
    """Why the planned host memory of this node's ranks does not fit in `available` bytes, or
    None (also where nothing is offloaded, or the host's memory is unknown)."""
    if not (cfg.offload or cfg.offload_model_state or cfg.offload_moments) or available is None:
        return None
    planned = plan_memory(cfg, world)
    need = planned["host"] * local_ranks
    if need <= available:
        return None
    parts = ", ".join(f"{name} {nbytes / 2**30:.1f}"
                      for name, nbytes in planned["host_parts"].items() if nbytes)
    ranks = f"{local_ranks} rank{'s' if local_ranks > 1 else ''}"
    return (f"the host memory planned for this node's {ranks}, {need / 2**30:.1f} GiB "
            f"({parts} GiB per rank), is more than the {available / 2**30:.1f} GiB available"
            + ("; --keep-attention doubles the offloaded checkpoints: drop it"
               if cfg.keep_attention else "")
            + "; or use more GPUs or a shorter --seq-len (python plan.py with the same flags "
              "shows the plan)")


def plan_auto_table(cfg: Config, machine: Machine) -> str:
    """`python plan.py ... --stack auto` (or no technique flag, at a --seq-len): the ranking,
    the fastest settings of each set of techniques that fits, fastest first; a GPU run takes the
    first, and the lines it prints follow."""
    choice = plan_run(cfg, machine)
    rates = step_time.rates_for(machine.gpu_name)
    fitting = [c for c in choice.ranking if c.fits]
    kernel = planned_kernel(cfg)
    speed = (f"step times predicted for {machine.gpu_name} GPUs (--gpu) with {kernel} attention"
             + (" (--attn-kernel fa4 ranks for FlashAttention-4)"
                if kernel == "cudnn" and cfg.attn_kernel == "auto" else "") if rates else
             f"no speed rates for {machine.gpu_name!r} (--gpu; support/step_time.py has "
             f"{', '.join(step_time.GPU_RATES)}): the memory-only order, the fewest techniques "
             f"first")
    rows = [f"--stack auto: {model_name(cfg)}, {plan_tokens_text(cfg.seq_len)} tokens x batch "
            f"{cfg.batch_size} on {gpus_text(machine.gpus)} of {machine.gpu_mem / GiB:.1f} GiB "
            f"({(machine.gpu_mem - PLAN_GPU_RESERVE) / GiB:.1f} usable) with {margin_text()}; "
            f"{speed}; {len(fitting)} of {len(choice.ranking)} sets of techniques fit, each "
            f"at its fastest settings",
            f"{'#':>3} {'step s':>8} {'tok/s/GPU':>10} {'peak GiB':>9} {'host GiB/GPU':>13}  flags"]
    for i, candidate in enumerate(fitting, 1):
        plan, seconds = candidate.plan, candidate.seconds
        speed = "-" if seconds is None else f"{tokens_per_s_per_gpu(candidate, machine):,.0f}"
        rows.append(f"{i:>3} {'-' if seconds is None else f'{seconds:.2f}':>8} {speed:>10} "
                    f"{plan['peak'] / GiB:>9.1f} {plan['host'] / GiB:>13.1f}  "
                    f"{flags_text(candidate.cfg)}")
    return "\n".join(rows + ["a GPU run takes #1 and says, in its first lines:"]
                     + ["  " + line for line in choice.lines])


# The flags shared with train.py that the plan reads.
FLAG_GROUPS = (config.add_model_flags, config.add_step_flags, config.add_accumulation_flags,
               config.add_document_flags, config.add_technique_flags)


def planner_argv(argv: list) -> list:
    """`python train.py --plan ...`: argv without --plan and the flags that only training reads
    (--lr, --save-dir, ...); at training's --seq-len unless it gives one (plan.py's own default
    is max)."""
    training_only = [group for group in config.FLAG_GROUPS if group not in FLAG_GROUPS]
    parser = config.flags_parser(training_only, add_help=False, allow_abbrev=False)
    return ["--seq-len", str(config.DEFAULTS.seq_len)] + [
        arg for arg in parser.parse_known_args(argv)[1] if arg != "--plan"]


def host_memory_line(host_mem_flag: str | None, host_mem: int, gpus_sharing: int) -> str:
    """The first line of every answer: the host memory assumed, which can decide it (offloaded
    checkpoints and model state live there), and how to change it."""
    node = f"{host_mem / GiB:.1f} GiB per node, shared by its {gpus_text(gpus_sharing)}"
    if host_mem_flag is None:
        return (f"host memory assumed: {node} (the default; it can decide the answer: give your "
                f"nodes' with --host-mem, e.g. --host-mem 251GiB)")
    return f"host memory assumed: {node} (--host-mem {host_mem_flag})"


def plan_main(argv) -> str:
    """`python plan.py ...` (or `python train.py --plan ...`): the per-GPU table at --seq-len, or
    with --seq-len max (the default) the longest length per stack level, or with --stack auto
    (or no technique flag) at --seq-len the ranking a GPU run chooses from; the first line says
    the host memory assumed. The flags shared with train.py mean what they mean there; the compute
    dtype defaults to bfloat16 (the GPUs')."""
    first_paragraph = " ".join(__doc__.split("\n\n")[0].split())
    parser = config.flags_parser(FLAG_GROUPS, description=first_paragraph,
                                 allow_abbrev=False)
    planner = parser.add_argument_group(
        "planner", "--seq-len max (the default): the longest length that fits, per --stack level")
    planner.add_argument("--gpus", type=int, default=8, help="GPUs planned for (default 8)")
    planner.add_argument("--gpu-mem", default=None,
                         help=f"memory per GPU (default: a named --gpu's as torch reports it, "
                              f"139.8GiB for h200, 79.2GiB for h100; without --gpu, or for a "
                              f"kind of unknown memory, {DEFAULT_GPU_MEM})")
    planner.add_argument("--host-mem", default=None,
                         help=f"host memory per node (default {DEFAULT_HOST_MEM}; it can decide "
                              f"the answer: give yours)")
    planner.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE,
                         help="GPUs that share a node's host memory")
    planner.add_argument("--scaling", type=int, nargs="*", default=None, metavar="GPUS",
                         help="with --seq-len max: the longest length on each GPU count (default "
                              "8 16 32 64), the model state on the GPUs and on the host")
    planner.add_argument("--eval", action="store_true", help="eval.py's forward only")
    planner.add_argument("--gpu", default=None, metavar="NAME",
                         help=f"the GPU kind whose speed --stack auto predicts, as "
                              f"torch.cuda.get_device_name() names it or a part of that name "
                              f"(h100), and its memory unless --gpu-mem says (default "
                              f"{DEFAULT_GPU}'s rates with {DEFAULT_GPU_MEM}; rates for: "
                              f"{', '.join(step_time.GPU_RATES)})")
    parser.set_defaults(dtype="bfloat16", seq_len="max")
    opts = parser.parse_args(argv)
    if opts.gpu is not None and not opts.gpu.strip():
        raise ValueError(f"--gpu needs a GPU's name or a part of it (rates for: "
                         f"{', '.join(step_time.GPU_RATES)})")
    gpu_given, opts.gpu = opts.gpu is not None, gpu_kind(opts.gpu or DEFAULT_GPU)
    longest = opts.seq_len.strip().lower() == "max"
    if longest and opts.stack == config.AUTO:
        raise ValueError("--stack auto ranks the configurations at one length: give --seq-len "
                         "(--seq-len max lists the longest per --stack level)")
    if longest:  # each row sets its own length and techniques (plan_levels): the base needs
        # none of them, but --offload-model-state alone is refused without FSDP
        opts.seq_len, opts.fsdp = str(config.DEFAULTS.seq_len), True
    cfg = config.config_from_flags(opts, reads_weights=False)
    host_mem = parse_bytes(opts.host_mem or DEFAULT_HOST_MEM)
    # A GPU named by --gpu brings its own memory, as a run on it would see it.
    gpu_mem = (parse_bytes(opts.gpu_mem) if opts.gpu_mem is not None
               else GPU_MEMORY[opts.gpu] if gpu_given and opts.gpu in GPU_MEMORY
               else parse_bytes(DEFAULT_GPU_MEM))
    if opts.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be at least 1, got {opts.gpus_per_node}")
    if opts.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {opts.gpus}")
    if opts.scaling == []:
        opts.scaling = [8, 16, 32, 64]
    for gpus in ([opts.gpus] if opts.scaling is None else opts.scaling):
        if gpus > opts.gpus_per_node and gpus % opts.gpus_per_node:
            raise ValueError(f"{gpus} GPUs are not whole nodes of {opts.gpus_per_node} "
                             f"(--gpus-per-node): the host memory is planned per node")
    if opts.eval and cfg.stack == config.AUTO:
        raise ValueError("--eval plans eval.py's forward for the techniques given; --stack auto "
                         "ranks training's: give the techniques (--stack 0-5)")
    if opts.scaling is not None:
        if not longest:
            raise ValueError("--scaling compares the longest lengths: add --seq-len max")
        if any(gpus < 1 for gpus in opts.scaling):
            raise ValueError(f"--scaling takes GPU counts of at least 1, got {opts.scaling}")
        answer = plan_scaling_table(cfg, opts.scaling, gpu_mem, host_mem,
                                    opts.gpus_per_node)
        sharing = opts.gpus_per_node
    else:
        if longest:
            answer = plan_longest_table(cfg, opts.gpus, gpu_mem, host_mem, opts.gpus_per_node,
                                        forward_only=opts.eval)
        elif opts.eval:
            answer = plan_forward_table(cfg, opts.gpus, gpu_mem)
        elif cfg.stack == config.AUTO or not config.techniques_given(cfg):  # the run's choice
            answer = plan_auto_table(replace(cfg, stack=config.AUTO), Machine(
                opts.gpus, opts.gpu, gpu_mem, host_mem,
                gpus_sharing_a_node(opts.gpus, opts.gpus_per_node)))
        else:
            answer = plan_table(cfg, opts.gpus, gpu_mem, host_mem, opts.gpus_per_node, opts.gpu)
        sharing = gpus_sharing_a_node(opts.gpus, opts.gpus_per_node)
    if gpu_given and opts.gpu_mem is None and opts.gpu not in GPU_MEMORY:  # a typo shows here
        answer += (f"\n(--gpu {opts.gpu!r}: no known memory size (known: "
                   f"{', '.join(GPU_MEMORY)}), planned with {DEFAULT_GPU_MEM} a GPU: give "
                   f"--gpu-mem)")
    return host_memory_line(opts.host_mem, host_mem, sharing) + "\n" + answer


def main(argv=None):
    try:
        print(plan_main(sys.argv[1:] if argv is None else list(argv)))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
