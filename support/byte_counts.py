"""byte_counts.py - the planner's byte formulas: what each technique holds per rank, in bytes.

plan.py adds these up into a step's peak; the lessons (01..06) hold the techniques themselves
and name their problem in bytes in their docstrings. One section per lesson, in file order; the
calibration (docs/calibration.md, tests/test_plan.py) holds each formula to measured peaks.
"""

import functools
from dataclasses import replace

import torch

from model import ModelArgs, Transformer, num_params
from base.host_buffers import power_of_two_pieces
from support.lessons import moments_offload, tiling, untied_sp

# ---- 01_fsdp.py: model state, sharded; FSDP2's gathered copies; the state on the host -------

def block_params(args) -> int:
    """One transformer block's parameters (Llama-3-8B: 218,112,000)."""
    return (num_params(args) - num_params(replace(args, n_layers=0))) // max(args.n_layers, 1)


def model_state_bytes(args, world_size: int) -> dict:
    """Per-rank bytes of model state with AdamW in mixed precision, sharded over `world_size`.

    fp32 parameters, fp32 gradients and two fp32 Adam moments are sharded; the bf16 copy of one
    block gathered for compute (and its gradient before reduce-scatter) is not, but is small.
    """
    n = num_params(args)
    per_rank = -(-n // world_size)  # ceil: FSDP pads the last shard
    return {"parameters": 4 * per_rank, "gradients": 4 * per_rank, "optimizer": 8 * per_rank}


def fsdp_buffer_bytes(args, bytes_per_value: int = 2, world_size: int = 1,
                      in_place: bool = False) -> dict:
    """Per-rank bytes of the unsharded copies FSDP2 makes, in the compute dtype, at four moments
    of a step. The "root" holds the embeddings, the final norm and lm_head; apply_fsdp keeps it
    (and the last block) gathered from forward to backward.

      after_forward:   the root's and the last block's gathered parameters;
      during_backward: the root's, two blocks' (the one in backward and the next, prefetched;
                       one in a one-layer model),
                       the running block's unsharded gradients, and lm_head's unsharded gradient
                       (the root's gradients are reduce-scattered only when backward ends);
                       this is the top block's backward, the first;
      below_the_top:   during_backward, and the block above's reduce-scatter input: its
                       unsharded gradients in the reduce dtype (fp32, 01's MixedPrecisionPolicy),
                       which FSDP2 keeps until the next block's post-backward starts its own
                       reduce-scatter (FSDPCommContext.reduce_scatter_state(s)), so through the
                       whole backward of every block below the top. (Llama-3-8B: 218M x 4 bytes
                       = 0.81 GiB, on any number of GPUs; measured at full depth, issue 44.)
      bottom_block:    below_the_top in the first block's backward (layer 0), the last: one
                       block gathered, as no block below it is prefetched;
      end_of_backward: the root's gradients on their way (its parameters already resharded):
                       its unsharded gradients copied into their fp32 reduce-scatter input
                       (its gradient shard, counted in the model state, not made yet), then
                       the input beside the new shard. On one GPU the shard is the whole
                       gradient and the later moment the larger: the input alone, 4 bytes
                       per root parameter (Llama-3-8B: 3.91 GiB, measured 3.97 at
                       step_llama3-8b_1gpu_16k_1l_undivided.json).

    in_place: one rank whose reduce-scatter output is its input (01's, base/gradient_memory.py:
    the gradient shards are views of the fp32 input): no input is held beside the gradients, so
    below the top nothing more, and at the end of backward only the root's unsharded
    gradients as they are copied into it.

    For Llama-3-8B in bf16: root 1.96 GiB, one block 0.41 GiB; on any number of GPUs.
    """
    root = num_params(replace(args, n_layers=0))
    block = block_params(args)
    gathered_blocks = min(args.n_layers, 2)
    during_backward = bytes_per_value * (root + (gathered_blocks + 1) * block
                                         + args.vocab_size * args.dim)
    if in_place:
        return {"after_forward": bytes_per_value * (root + block),
                "during_backward": during_backward, "below_the_top": during_backward,
                "bottom_block": during_backward - bytes_per_value * block,
                "end_of_backward": bytes_per_value * root}
    return {"after_forward": bytes_per_value * (root + block),
            "during_backward": during_backward,
            "below_the_top": during_backward + REDUCE_BYTES * block,
            "bottom_block": during_backward + (REDUCE_BYTES - bytes_per_value) * block,
            "end_of_backward": max((bytes_per_value + REDUCE_BYTES) * root
                                   - REDUCE_BYTES * -(-root // world_size), REDUCE_BYTES * root)}


REDUCE_BYTES = 4  # FSDP2 reduces gradients in fp32 (01's MixedPrecisionPolicy: reduce_dtype)


def offloaded_model_state_bytes(args, world_size: int, pinned: bool = True) -> dict:
    """Per-rank host bytes of the model state with --offload-model-state: the same shards as
    model_state_bytes, in host memory. pinned=True: parameters and gradients as the pinned
    allocator reserves them, each shard rounded up to a power of two (FSDP2 pins each
    parameter's shard; the gradient shards arrive by non-blocking copies into pinned memory);
    Adam's moments are ordinary (pageable) host memory, exact."""
    shapes = block_and_root_shapes(tuple(vars(replace(args, n_layers=1)).items()))
    round_up = (lambda n: 1 << (n - 1).bit_length()) if pinned else (lambda n: n)
    held = 0  # one rank's pinned fp32 shards: dim 0 split over the ranks (padded)
    for name, shape in shapes.items():
        rows, cols = shape[0], (shape.numel() // shape[0] if shape[0] else 0)
        shard = round_up(4 * -(-rows // world_size) * cols)
        held += shard * (args.n_layers if name.startswith("layers.") else 1)
    return {"parameters": held, "gradients": held,
            "optimizer": model_state_bytes(args, world_size)["optimizer"]}


def gradient_stream_cache_bytes(args, world_size: int, offload_model_state: bool = False) -> int:
    """Per-rank GPU bytes the caching allocator holds for FSDP2's reduce-scatter stream between
    steps: the fp32 gradient shards it made there, freed by zero_grad (with
    --offload-model-state the root's shard, the largest before its copy to the host: not
    measured). A block freed on one stream is cached for that stream alone: the default stream
    cannot reuse these bytes without an allocator retry (support/step_time.py). Measured after
    a step on one H200 (bench.step's cached_by_stream_gib): 29.92 GiB for Llama-3-8B, 4.75 for
    its one-layer model, each its gradients (b79eb9f; before it, 01's divided copy of the
    root's gradients was cached there too: 33.85 and 8.65 GiB, 13.44 for Llama-3.2-3B). Those
    are FSDP2's own allocation; 01 now takes them from the compute stream's memory instead
    (base/gradient_memory.py; at bd79859 that stream cached nothing after a step)."""
    if offload_model_state:
        return REDUCE_BYTES * -(-num_params(replace(args, n_layers=0)) // world_size)
    return model_state_bytes(args, world_size)["gradients"]


@functools.cache
def block_and_root_shapes(args_fields: tuple) -> dict:
    """The parameter shapes of a one-block model of these ModelArgs fields, from the meta device
    (no memory); remembered, as the planner asks for the same model's many times."""
    with torch.device("meta"):
        model = Transformer(ModelArgs(**dict(args_fields)))
        return {name: p.shape for name, p in model.named_parameters()}


def offload_transfer_bytes(args, world_size: int) -> dict:
    """Per-rank GPU bytes in flight with --offload-model-state, at fsdp_buffer_bytes' moments:
    a group's fp32 shard copied in (and cast) for its all-gather, and a gradient shard after
    its reduce-scatter, before it is copied to the host. Nothing after forward, and nothing at
    a block's backward peak: the copy-in is freed once the prefetched all-gather has its input,
    and the running block's gradient shard does not exist yet. At the end of backward the
    root's gradient shard."""
    root = num_params(replace(args, n_layers=0))
    return {"after_forward": 0, "during_backward": 0, "below_the_top": 0, "bottom_block": 0,
            "end_of_backward": 4 * -(-root // world_size)}


# ---- base/kernels.py: what an attention backward kernel allocates for itself -------------

def backward_workspace_bytes(n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                             bytes_per_value: int = 2, kernel: str = "cudnn") -> int:
    """What the attention backward kernel allocates for itself, beyond its inputs and its dq,
    dk, dv, over `n_tokens` tokens with `n_heads` query and `n_kv_heads` KV heads.

    cuDNN (and FlashAttention-2): dq accumulated in fp32; with grouped-query attention dk and
    dv per query head before they are summed over the group; an fp32 row sum of dO * O.
    FlashAttention-4: dq accumulated in fp32; with grouped-query attention dk and dv
    accumulated in fp32 per KV head (not per query head); two fp32 rows (dO * O and the
    log-sum-exp in base 2). A CPU kernel differs."""
    q_values, kv_values = n_tokens * n_heads * head_dim, n_tokens * n_kv_heads * head_dim
    grouped = n_heads > n_kv_heads
    if kernel == "fa4":
        return 4 * q_values + (2 * 4 * kv_values if grouped else 0) + 2 * 4 * n_tokens * n_heads
    grouped_grads = 2 * q_values * bytes_per_value if grouped else 0
    return 4 * q_values + grouped_grads + 4 * n_tokens * n_heads


# ---- 02_ulysses.py: one attention layer's activations per rank -----------------------------

def attention_activation_bytes(args, seq_len: int, sp: int, bytes_per_value: int = 2,
                               saved_only: bool = False, kernel: str = "cudnn",
                               workspace=backward_workspace_bytes) -> int:
    """Bytes one attention layer (normed input -> output before o_proj) holds per rank, beyond
    its input and its output gradient: the most at once during forward and backward (default;
    the peak is in backward), or what it keeps from forward for backward (saved_only).
    sp=1 is plain attention, no exchange.

    Per rank, local tokens N = seq_len / sp; Q = N x H x D and K = N x max(Hkv, sp) x D values
    take the same bytes in the token layout and in the head layout (all tokens, 1/sp of heads):
      kept for backward: q, k, v and the output in the head layout (the kernel's inputs and
        output), its fp32 log-sum-exp (N x H), and with sp > 1 the output back in the token
        layout (o_proj's input): 2Q + 2K + lse (+ Q);
      added in backward: the output gradient in the head layout (sp > 1: + Q); dq, dk, dv
        (Q + 2K); the kernel's workspace (`backward_workspace_bytes`: 2Q for the fp32 dq, 2Q
        for grouped dk/dv, an lse-sized row sum).
    In all 10Q + 2 lse for Llama-3-8B (32 query, 8 KV heads) with sp > 1: 30 GiB per GPU at 3M
    tokens on 8 GPUs.
    """
    local_tokens = seq_len // sp
    kv_heads = max(args.n_kv_heads, sp) if sp > 1 else args.n_kv_heads  # replicated up to sp
    q = local_tokens * args.n_heads * args.head_dim * bytes_per_value
    kv = local_tokens * kv_heads * args.head_dim * bytes_per_value
    lse = local_tokens * args.n_heads * 4
    exchanged = q if sp > 1 else 0
    saved = 2 * q + 2 * kv + lse + exchanged
    if saved_only:
        return saved
    # workspace: the kernel's, over all seq_len tokens; with 06's ring (seq_len = a ring rank's
    # S/R tokens, sp = P/R) the ring's buffers instead (ring_buffer_bytes).
    workspace = workspace(seq_len, args.n_heads // sp, kv_heads // sp, args.head_dim,
                          bytes_per_value, kernel)
    return saved + exchanged + q + 2 * kv + workspace


# ---- 03_checkpoint_offload.py: saved block inputs, on the GPU or the host; a block's recompute

def checkpoint_memory_bytes(args, seq_len: int, sp: int, offload: bool,
                            bytes_per_value: int = 2, pinned: bool = False,
                            also_kept: list[int] = (), layers: int | None = None) -> dict:
    """Per-rank bytes of saved block inputs between forward and backward: {"gpu", "host"}.

    Each block input is local tokens x dim. Without offload all `layers` checkpointed blocks'
    (--checkpoint-layers; None: all n_layers) stay on the GPU; with offload only the last
    checkpointed block's does, and layers - 1 live in pinned host memory. (During backward the
    GPU holds two at a time: the one the current block recomputes from and the next one coming
    back.) The recompute of one block's activations is `block_recompute_bytes`; the blocks not
    checkpointed keep their activations, as without 03 (plan.py adds them).
    pinned=True: the host bytes as the pinned allocator reserves them for the offloader's
    power-of-two pieces (base/host_buffers.py): the data, to within 2 MiB per tensor.
    also_kept: the bytes of each other tensor a block keeps where its input is kept
    (--keep-attention: kept_attention_bytes).
    """
    layers = args.n_layers if layers is None else layers
    per_layer = [seq_len // sp * args.dim * bytes_per_value, *also_kept]
    host_buffer = sum(sum(power_of_two_pieces(n)) if pinned else n for n in per_layer)
    on_host = max(layers - 1, 0) * host_buffer if offload else 0
    on_gpu = sum(per_layer) * (min(layers, 1) if offload else layers)
    return {"gpu": on_gpu, "host": on_host}


def block_recompute_bytes(args, local_tokens: int, bytes_per_value: int = 2,
                          fused_norm: bool = True) -> dict:
    """What one block keeps for its backward besides attention (02/05) and the MLP (04), and
    the peak of one RMSNorm's backward: the part of "one block's recompute" that model.py's
    RMSNorm costs. Checkpointing rebuilds this for one block at a time; without it every block
    keeps its "saved" until backward reaches it. Per token:

      saved: each RMSNorm's output is kept by the projections (or the MLP) that read it; the
        fused kernel (F.rms_norm on CUDA) keeps its input and 1/rms (4 bytes): the
        post-attention norm's input is the residual stream h (post_norm_input, until that
        norm's backward), the first norm's the block input (block_input: with checkpointing
        it is the checkpoint itself, no extra bytes);
      first_norm: the first norm's share of it, kept until the block's input gradient is done;
      norm_backward: the fused backward's input gradient (its weight gradient's partial sums,
        a few hundred rows of dim, are left out);
      released: what a block that 03 leaves unchecked gives back of "saved" from its forward
        until backward reaches it: its two norms' outputs (03's recompute_norms computes them
        again from the inputs the norms keep).
    fused_norm=False, the norm op by op (F.rms_norm off CUDA; model.py before it called
    F.rms_norm, when the GPU calibration rows so marked were measured): each norm keeps an
    fp32 copy of its input, the normalized copy and 1/rms instead of its input (so
    post_norm_input and block_input are 0), 2 x (dim x (4 + 2 x bytes) + 4); its backward peaks
    in the gradient of x^2, with the fp32 input copy and five fp32 token-sized tensors alive:
    24 x dim bytes; its outputs released, the inputs that recompute_norms holds to compute
    them again are kept by nothing else where narrower than fp32 (the norm keeps an fp32 copy):
    nothing is given back then.

    Llama-3-8B, 393,216 tokens per GPU (3M on 8): saved 9 GiB (op by op 24 GiB), norm
    backward 3 GiB (op by op 36 GiB).
    """
    dim, tokens = args.dim, local_tokens
    if fused_norm:
        hidden = bytes_per_value * dim * tokens
        return {"saved": 3 * hidden + 2 * 4 * tokens, "first_norm": hidden + 4 * tokens,
                "post_norm_input": hidden, "block_input": hidden, "norm_backward": hidden,
                "released": 2 * hidden}
    one_norm = dim * (4 + 2 * bytes_per_value) + 4
    return {"saved": 2 * one_norm * tokens, "first_norm": one_norm * tokens,
            "post_norm_input": 0, "block_input": 0, "norm_backward": 24 * dim * tokens,
            "released": 2 * bytes_per_value * dim * tokens if bytes_per_value >= 4 else 0}


def kept_attention_bytes(args, seq_len: int, sp: int, bytes_per_value: int = 2) -> list[int]:
    """--keep-attention (support/keep_attention.py): the bytes of what one block keeps besides
    its input, per tensor: the attention output (a rank's share of seq x heads x head_dim; the
    size of the block input when heads x head_dim = dim, as in Llama) and its fp32 log-sum-exp,
    one per head and token (1/64 of the output for head_dim 128 in bf16). 05 keeps the latter
    as one tensor per stage; the same bytes."""
    local_tokens = seq_len // sp
    return [local_tokens * args.n_heads * args.head_dim * bytes_per_value,
            local_tokens * args.n_heads * 4]


# ---- 04_alst_tiling.py: the MLP's, the loss's and the norms' token-sized temporaries --------

# Until 04 wrote its tiles' backward by hand, each tile ran autograd.grad: a
# bf16 weight gradient per tile beside the fp32 sum, three fp32 logits-sized tensors in the loss
# tile's backward, the fused norm's backward in a norm tile. The calibration rows measured then
# say "tile_backward": "autograd" and are predicted with autograd_tiles=True. The untiled
# MLP kept more before base/fused.py's SwiGLUDown: the rows measured then say how
# (swiglu=, SWIGLU_KEPT).

SWIGLU_KEPT = {  # tokens x ffn_dim tensors an untiled MLP keeps for backward, by row marker
    "autograd": 4,   # before base/fused.py: gate, up, silu(gate), down_proj's input
    "fused act": 3,  # base/fused.py's activation alone: gate, up, down_proj's input
    None: 2,         # SwiGLUDown: gate and up
}

def mlp_temporary_bytes(args, local_tokens: int, tiled: bool, tile_tokens: int | None = None,
                        bytes_per_value: int = 2, saved_only: bool = False,
                        autograd_tiles: bool = False, swiglu: str | None = None) -> int:
    """Bytes of the MLP's own tensors while one layer runs forward and backward, beyond its input
    and output gradient: the peak, in backward (default), or what it keeps for backward.

    Untiled: gate and up are kept, ffn_dim values per token each (2 x tokens x ffn_dim;
    base/fused.py's SwiGLUDown computes down_proj's input again in backward); in backward that
    input (freed after its weight's gradient), then the gradient of the activation and the two
    it splits into, with gate and up, are five such tensors at once. Tiled: nothing is kept
    but the input;
    backward holds the input-gradient buffer (tokens x dim), one tile's intermediates (04's
    swiglu_backward: five with the fused kernels on CUDA, six op by op; counted as six), and
    the three weight gradients' fp32 sums (3 x dim x ffn_dim x 4),
    into which each tile's matmul accumulates (the sums' casts to the weights' dtype are the
    unsharded gradients FSDP's count holds).
    Llama-3-8B, 393,216 tokens per GPU: 52.5 GiB untiled, 4.3 GiB tiled (4,096-token tiles).
    autograd_tiles, swiglu: as the rows measured before (the note above; autograd's SwiGLU
    kept four such tensors and its backward peaked at six).
    """
    ffn, dim, b = args.ffn_dim, args.dim, bytes_per_value
    if not tiled:
        kept = SWIGLU_KEPT[swiglu]
        return (kept if saved_only else max(kept + 2, 5)) * local_tokens * ffn * b
    if saved_only:
        return 0
    tile = min(tiling.mlp_tile_size(dim, local_tokens, tile_tokens), local_tokens)
    weight_grads = 3 * dim * ffn * (4 + b if autograd_tiles else 4)
    return local_tokens * dim * b + 6 * tile * ffn * b + weight_grads


def loss_temporary_bytes(args, local_tokens: int, tiled: bool, tile_tokens: int | None = None,
                         bytes_per_value: int = 2, fused_norm: bool = True,
                         autograd_tiles: bool = False, fp32_loss: bool = False) -> int:
    """Bytes the loss seam (final norm + lm_head + cross-entropy) holds at its peak: in backward
    untiled; tiled, in its forward, which runs each tile's backward (04's TiledLoss).

    Untiled: the final RMSNorm keeps its input, 1/rms and its output (lm_head's input),
    2 x dim x bytes + 4 per token (op by op, fused_norm=False: an fp32 copy of its input, the
    normalized copy and the output, dim x (4 + 2 x bytes)); then the logits, tokens x vocab:
    base/fused.py's cross-entropy keeps them in the compute dtype and writes their gradient in
    it, 2 x bytes per logit at its backward. Tiled: the input and the input-gradient buffer
    that backward keeps in its place (2 x tokens x dim), one tile's logits and their gradient
    (2 x bytes per logit), and lm_head's weight gradient summed in fp32 (vocab x dim x 4).
    Llama-3-8B, 393,216 tokens per GPU: 194 GiB untiled, 8.96 GiB tiled (fp32_loss: 570, 9.96).
    fp32_loss: as the rows measured before the fused cross-entropy, with fp32 logits (untiled,
    autograd's log-softmax output, its incoming gradient and its input gradient at once, 3 x 4
    bytes per logit; tiled, a tile's fp32 logits and their softmax, 2 x 4).
    autograd_tiles: as the rows measured while each tile ran autograd (the note above).
    """
    vocab, dim, b = args.vocab_size, args.dim, bytes_per_value
    per_logit = 3 * 4 if fp32_loss else 2 * b
    if not tiled:
        final_norm = 2 * dim * b + 4 if fused_norm else dim * (4 + 2 * b)
        return local_tokens * (per_logit * vocab + final_norm)
    tile = min(tiling.loss_tile_size(vocab, local_tokens, tile_tokens), local_tokens)
    per_logit, lm_head = (3 * 4, 4 + b) if autograd_tiles else (2 * 4 if fp32_loss else 2 * b, 4)
    return 2 * local_tokens * dim * b + per_logit * tile * vocab + vocab * dim * lm_head


def norm_temporary_bytes(args, local_tokens: int, tile_tokens: int | None = None,
                         bytes_per_value: int = 2, fused_norm: bool = True,
                         autograd_tiles: bool = False) -> dict:
    """The tiled counterpart of block_recompute_bytes (untiled RMSNorms), same keys. Per
    block: the two norms' outputs, kept by the projections and the MLP that read them, and the
    inputs the tiled norms keep (04's TiledNorm saves its input): the post-attention norm's
    input, the residual stream h (post_norm_input, until that norm's backward), and the first
    norm's input, the block input (block_input: with checkpointing it is the checkpoint
    itself, no extra bytes); the peak of one norm's backward: one tile's six fp32 tensors
    (04's rms_norm_backward runs op by op on every device). autograd_tiles (the note above):
    each tile ran autograd through rms_norm, whose fused kernel (fused_norm) held one tile's
    output and input gradient. released: the two outputs (03's recompute_norms)."""
    tile = min(tiling.norm_tile_size(args.dim, local_tokens, tile_tokens), local_tokens)
    hidden = bytes_per_value * args.dim * local_tokens
    return {"saved": 3 * hidden, "first_norm": hidden, "post_norm_input": hidden,
            "block_input": hidden, "released": 2 * hidden,
            "norm_backward": (2 * bytes_per_value if fused_norm and autograd_tiles else 24)
                             * args.dim * tile}


# ---- 05_untied_ulysses.py: one headwise stage at a time -------------------------------------

def untied_attention_bytes(args, seq_len: int, sp: int, head_chunk: int | None,
                           bytes_per_value: int = 2, saved_only: bool = False,
                           kernel: str = "cudnn", workspace=backward_workspace_bytes) -> int:
    """Bytes one Untied Ulysses attention layer holds per rank beyond its input and its output
    gradient, counted like `attention_activation_bytes`: the peak (in backward), or what
    it keeps for backward (saved_only: the output buffer, local tokens x all heads, and every
    stage's fp32 log-sum-exp). The backward also holds the input-gradient buffer and the zeroed
    q/k/v weight gradients, and at one stage's attention kernel, with q_s = U heads x local
    tokens and kv_s = its KV heads:
      its KV group's k and v (2 kv_s); the stage's q, output and output gradient in the head
        layout (3 q_s; with one rank only q: the others are views); dq, dk, dv (q_s + 2 kv_s);
        the kernel's workspace (02); and when a KV group spans several stages, its K/V
        gradients summed over them (2 kv_s).
    Llama-3-8B, 3M tokens on 8 GPUs, U = 8: 15.1 GiB (Ulysses: 30.1).
    """
    head_chunk = untied_sp.check_head_chunk(args.n_heads, args.n_kv_heads, sp, head_chunk)
    local_tokens = seq_len // sp
    b = bytes_per_value
    heads_per_rank_per_stage = head_chunk // sp
    group_size = args.n_heads // args.n_kv_heads
    if args.n_kv_heads >= sp:
        kv_heads = max(1, heads_per_rank_per_stage // group_size)  # per rank and stage
        stages_per_kv_group = max(1, group_size // heads_per_rank_per_stage)
    else:  # one replicated KV head per rank, shared by all stages
        kv_heads, stages_per_kv_group = 1, args.n_heads // head_chunk
    q_stage = local_tokens * head_chunk * args.head_dim * b
    kv_stage = local_tokens * sp * kv_heads * args.head_dim * b
    saved = local_tokens * args.n_heads * args.head_dim * b + local_tokens * args.n_heads * 4
    if saved_only:
        return saved
    gradients = (local_tokens * args.dim * b
                 + (args.n_heads + 2 * args.n_kv_heads) * args.head_dim * args.dim * b)
    # With one rank the exchanges copy nothing: the stage's output and output gradient in the
    # head layout are views of the saved output and the incoming gradient, so only q is new.
    head_layout = 3 if sp > 1 else 1
    stage = 2 * kv_stage + head_layout * q_stage + q_stage + 2 * kv_stage
    if stages_per_kv_group > 1:
        stage += 2 * kv_stage
    # The kernel's workspace over all seq_len tokens; with 06's ring (seq_len = a ring rank's
    # S/R tokens, sp = P/R) the ring's buffers for one stage instead.
    stage += workspace(seq_len, heads_per_rank_per_stage, kv_heads, args.head_dim, b, kernel)
    return saved + gradients + stage


# ---- 06_ring_attention.py: a ring rank's K/V blocks in flight -------------------------------

def ring_attention_bytes(args, seq_len: int, sp: int, ring: int, bytes_per_value: int = 2,
                         kernel: str = "cudnn") -> int:
    """Bytes ring attention allocates per rank beyond its inputs (q, k, v, the output gradient)
    and results (out, lse, dq, dk, dv), at its peak, in backward, for a whole attention layer
    of Ulysses over P/R ranks around the ring: `ring_buffer_bytes` for this rank's S/R tokens,
    H/(P/R) query heads and max(Hkv, P/R)/(P/R) KV heads (replicated up to P/R, as in 02)."""
    ulysses_size = sp // ring
    kv_heads = max(args.n_kv_heads, ulysses_size) // ulysses_size
    return ring_buffer_bytes(seq_len // ring, args.n_heads // ulysses_size, kv_heads,
                             args.head_dim, bytes_per_value, kernel)


def ring_buffer_bytes(n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                      bytes_per_value: int = 2, kernel: str = "cudnn") -> int:
    """What the ring holds in place of one kernel's backward workspace over a ring rank's
    n_tokens = S/R tokens (2 chunks of C = N/2): the planner passes this to 02's and 05's byte
    formulas as their `workspace` (same arguments as backward_workspace_bytes):
      K/V blocks in flight: the one in use and the one arriving (2 K/V blocks);
      dK/dV in flight, fp32: the one sent on and the one arriving (2 blocks);
      dq accumulated in fp32 (N x heads x D x 4);
      one step's K/V gradients from the kernel, kept until the travelling dK/dV arrives: up to
        3 block pairs of C keys (step 0);
      one block pair's backward: its dq (C tokens) and the kernel's workspace for C tokens.
    The forward holds less: 2 K/V blocks, the fp32 output (N x heads x D x 4), one block's output.
    """
    b, chunk = bytes_per_value, n_tokens // 2
    kv_values = 2 * n_tokens * n_kv_heads * head_dim  # k and v of one rank
    key_grads = 3 * 2 * chunk * n_kv_heads * head_dim * b
    block_pair = (chunk * n_heads * head_dim * b
                  + backward_workspace_bytes(chunk, n_heads, n_kv_heads, head_dim, b, kernel))
    return (2 * kv_values * b + 2 * kv_values * 4 + n_tokens * n_heads * head_dim * 4
            + key_grads + block_pair)


def hybrid_attention_bytes(args, seq_len: int, sp: int, ring: int, bytes_per_value: int = 2,
                           saved_only: bool = False, kernel: str = "cudnn", untied: bool = False,
                           head_chunk: int | None = None) -> int:
    """02's (or with untied, 05's) attention bytes for Ulysses over P/R ranks that each hold a
    ring rank's S/R tokens, with the ring's buffers in place of one kernel over them. R = 1:
    02's and 05's own counts, unchanged."""
    workspace = ring_buffer_bytes if ring > 1 else backward_workspace_bytes
    if untied:
        return untied_attention_bytes(args, seq_len // ring, sp // ring, head_chunk,
                                      bytes_per_value, saved_only, kernel, workspace)
    return attention_activation_bytes(args, seq_len // ring, sp // ring, bytes_per_value,
                                      saved_only, kernel, workspace)


# ---- 09_offload_moments.py: the blocks' Adam moments on the host, a few blocks' on the GPU ----

def streamed_moment_bytes(args, world_size: int, fsdp: bool = True,
                          bytes_per_value: int = 2) -> dict:
    """Per-rank bytes of 09's moments (fp32 under FSDP, 01's master state; without it the
    compute dtype's `bytes_per_value`): "block", one block's two moments (its shards: dim 0
    split over the ranks, padded), which each step copies in and out; "host", every block's,
    page-locked in place (exactly their bytes); "slots", the GPU buffers that hold
    moments_offload.SLOTS blocks' from the optimizer step to the end of the next forward."""
    moment_bytes = 4 if fsdp else bytes_per_value
    block = 2 * moment_bytes * -(-block_params(args) // world_size)
    return {"block": block, "host": args.n_layers * block, "slots": moments_offload.SLOTS * block}
