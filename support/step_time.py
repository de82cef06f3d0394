"""step_time.py - the speed model: how long one training step takes on a GPU, without one.

plan.py ranks the configurations that fit by this prediction (`--stack auto`); bench/throughput.py
counts its FLOPs with `step_flops` below (MFU and its kernel bound). A step is the sum of simple
terms, one section per lesson as support/byte_counts.py has for bytes:

    linear layers      FLOPs at the GPU's matmul rate
    attention          causal FLOPs at the attention kernel's rate
    elementwise        per token, layer and unit of width (norms, rotary, SwiGLU, residuals,
                       casts), once per pass over the blocks
    the loss           its logits' bytes through memory; 04's fp32 weight-gradient sums per tile
    03                 the recompute (one more forward of the checkpointed blocks; with
                       --keep-attention without attention's; the norms' outputs of the
                       others), and the offload copies that no compute hides
    02 / 05 / 06       Ulysses' exchanges; Untied Ulysses' per-stage cost; the ring's blocks
    the allocator      a plan that leaves little free at its peak: the caching allocator
                       gives its cached blocks back and tries again (a retry, which
                       synchronizes the GPU), once a step below FRAGMENTATION_BLOCKS' room; twice
                       below what FSDP2's reduce-scatter stream keeps cached where FSDP2
                       allocates the gradients itself (--offload-model-state)
    01                 the optimizer step on the GPU, or on the host (--offload-model-state:
                       CPU fused AdamW) with its copies (FSDP's own per-parameter cost fitted
                       to nothing once the allocator's retries were counted: it is not a term);
                       on several GPUs the all-gathers and reduce-scatters that a block's
                       compute does not hide (short sequences split over many GPUs)
    08                 the part of that step run beside the next forward that still shows
    09                 the moments' copies in and out that the forward does not hide
Rates come per GPU kind (`GPU_RATES`, keyed by torch.cuda.get_device_name()): the kernels'
measured speeds, and a few constants fitted on measured steps (docs/calibration.md, "Step
time"; tests/test_step_time.py holds every calibrated row within 10%). A GPU without rates gets
no prediction: the planner then falls back to its memory-only choice and says so.
"""

from dataclasses import dataclass, replace

import model
from support import byte_counts
from support.config import Config, checkpointed_layers, model_args
from support.lessons import tiling
from support.runtime import check_layout


@dataclass(frozen=True)
class GpuRates:
    """One GPU kind's speeds. Measured: FLOP/s of a bf16 matmul at the model's shapes and of
    each attention kernel (causal, forward + backward), bytes/s of memory-bound work, of pinned
    host <-> GPU copies (each way) and of NCCL's all-to-all per GPU; seconds per element of one
    RMSNorm's forward + backward, fused and op by op. Fitted on measured steps: the seconds of
    elementwise work per token, layer and unit of width (dim + ffn_dim) per pass, with
    base/fused.py's kernels (SwiGLU, rotary) and with those forms op by op, of an Untied
    Ulysses stage that exchanges per token and layer, of the host's AdamW step per parameter
    of a rank, and of one allocator retry."""
    matmul: float
    attention: dict
    memory: float
    pinned_copy: float
    all_to_all: float
    norm_fused_s: float
    norm_op_by_op_s: float
    elementwise_s: float
    elementwise_op_by_op_s: float
    stage_s: float
    host_adamw_s: float
    alloc_retry_s: float


GPU_RATES = {
    # Sources (docs/results): matmul and attention, bench.throughput's own measurements at
    # 128K-1M (throughput_*.json "kernel_rates": matmul 667-811, median ~685 TFLOP/s; FA4
    # 612-633; cuDNN 526-560); memory: the fp32 gradient sums of grad_sums_1gpu.json (a 4,096 x
    # 14,336 fp32 sum read and written with its bf16 tile gradient, 10 bytes per value, in
    # 0.21 ms); pinned copies: offload_llama3-8b_2gpu.json (55.1 GB/s each way); all-to-all:
    # GUIDE's 280 GiB/s between 2 H200s; norms: rms_norm_1gpu.json (2.47 and 20.8 ms for 128K x
    # 4096). The last five: fitted (tests/test_step_time.py --fit).
    "NVIDIA H200": GpuRates(
        matmul=685e12, attention={"fa4": 620e12, "cudnn": 540e12, "flash": 320e12},
        memory=2.8e12, pinned_copy=55e9, all_to_all=280 * 2**30,
        norm_fused_s=2.473e-3 / (131072 * 4096), norm_op_by_op_s=20.824e-3 / (131072 * 4096),
        elementwise_s=4.98e-12, elementwise_op_by_op_s=1.04e-11, stage_s=7.09e-8,
        host_adamw_s=7.94e-10, alloc_retry_s=0.0845),
}
# The H100 (SXM, 80 GB HBM3) has the H200's GH100 compute: 132 SMs, the same clocks and 700 W,
# its kernels measured within a few percent of the H200's (GEMMs at Llama-3.2-3B's shapes 743-751
# TFLOP/s, FA4 628-641 at 16K-32K: bound_llama3.2-3b_1gpu_h100_08ab.json). So it takes the
# H200's rates and fitted constants, its memory-bound passes (AdamW, the tiles' sums, the
# logits) at its HBM3's 3.35 TB/s against the H200's 4.8. Held against its eight measured steps
# (Llama-3.2-3B, 16K and 32K) in docs/calibration.md, not fitted on them.
GPU_RATES["NVIDIA H100 80GB HBM3"] = replace(GPU_RATES["NVIDIA H200"],
                                             memory=GPU_RATES["NVIDIA H200"].memory * 3.35 / 4.8)

RING_RATE = 0.985  # 06's blocks against one causal call: 0.992 (R = 2), 0.985 (R = 4), FA4 at
# 512K (ring_blocks_llama3-8b_1gpu_512k.json); the K/V blocks travel behind the kernel
LOGIT_BYTES = 14  # per logit and step (base/fused.py's cross-entropy): bf16 out, two reads for
# the log-sum-exp in forward and two in backward, a read and the bf16 gradient written
RECOMPUTED_LOGIT_BYTES = 2  # 04's tiled loss computed each tile's logits again in backward
# (the rows measured before it ran each tile's backward in its forward: recompute_logits)
FP32_LOGIT_BYTES = (30, 10)  # the two, before: fp32 copy, log-softmax, its gradient and cast
GRAD_SUM_BYTES = 10  # per weight value and tile: its bf16 gradient read, the fp32 sum read, written
ADAMW_BYTES = 32  # per fp32 parameter: AdamW reads 4 tensors and writes 3; the gradient norm
# reads the gradients once (train.clipped_step): NORM_BYTES of them
NORM_BYTES = 4
CLIP_BYTES = 4  # with --grad-clip: AdamW writes each gradient back, divided by the clip
BESIDE_FORWARD_SHOWN = 0.78  # 08: the share of an update run beside the forward that still
# lengthens the step (its kernels take SMs and memory bandwidth from the forward's). Measured on
# one H100 (Llama-3.2-3B, --stack auto, 16K and 32K, 6 and 10 steps each; docs/results.md):
# 08 took 3.5-19.2 ms off a step (08's arm timed from step 2, bench.report.first_timed_step),
# the mean 9.7 ms of the 44.5 ms this model's later blocks' updates take at the H200's memory
# rate scaled to the H100's bandwidth (3.35 / 4.8 TB/s): 1 - 9.7 / 44.5 = 0.78 still shows


BOTH_WAYS = 0.91  # each direction's share of the pinned-copy rate while the other runs too:
# alone, 50.0-50.3 GB/s each way at once against 55.2-55.4 one way (one H100 machine,
# copy_rates_h100.json). Since 09 queues a block's copies as the forward nears it, the steps
# whose forward runs at the copies' pace (Llama-3-8B at 8K and 10K with 09 on one H100) come
# within 6.1% and 7.4% with it (0.8 was fitted on the same steps while all the copies were
# queued at once)


def rates_for(gpu_name: str | None) -> GpuRates | None:
    """This GPU kind's rates (torch.cuda.get_device_name()), or None: no speed model for it."""
    return GPU_RATES.get(gpu_name)


# ---- The FLOPs of a step (bench/throughput.py's MFU and bound count the same) ----------------

def step_flops(args, seq_len: int, sequences: int = 1, keep_attention: bool = False, *,
               checkpoint: bool = True, tile_mlp: bool = True, tile_loss: bool = True,
               checkpoint_layers: int | None = None, recompute_down: bool = False,
               recompute_logits: bool = False) -> dict:
    """FLOPs of one step of `sequences` sequences of `seq_len` tokens, on all GPUs together:
    {"attention": causal attention, "linear": the linear layers}. Per layer, causal attention's
    forward is 2 S^2 d (d = heads x head dim), its backward 2.5x that, and 03's recompute (with
    `checkpoint`, in its first `checkpoint_layers` blocks: None, all) one more forward unless
    `keep_attention`; a linear layer's forward is 2 x its parameters x tokens, its backward
    twice that, and one more forward where it runs again: the attention projections of the
    blocks 03 recomputes; the MLP's gate and up there or under 04's tiling (whose backward
    recomputes each tile; 03 then skips it), but not down_proj, whose output neither
    recompute needs (base/fused.py's SwiGLUDown and 04's tiles skip it; recompute_down: as
    the rows measured before they did); lm_head never (04's tiled loss runs each tile's
    backward in its forward; recompute_logits: as the rows measured before it did, which
    recomputed each tile's logits in backward). The defaults are the ALST stack
    bench/throughput.py measures."""
    layers = args.n_layers
    recomputed = (checkpoint_layers or layers) if checkpoint else 0  # blocks run twice forward
    d = args.n_heads * args.head_dim
    attention_forward = 2 * seq_len**2 * d * sequences  # one layer's
    projections = args.dim * d + 2 * args.dim * args.n_kv_heads * args.head_dim + d * args.dim
    gate_up, down = 2 * args.dim * args.ffn_dim, args.dim * args.ffn_dim
    mlp_again = layers if tile_mlp else recomputed  # blocks whose gate and up run again
    linear_forward = 2 * seq_len * sequences
    return {"attention": attention_forward * (3.5 * layers + recomputed * (not keep_attention)),
            "linear": linear_forward * (projections * (3 * layers + recomputed)
                                        + (gate_up + down) * 3 * layers + gate_up * mlp_again
                                        + down * mlp_again * recompute_down
                                        + args.dim * args.vocab_size
                                        * (3 + (tile_loss and recompute_logits)))}


# ---- A step's time per GPU, by term --------------------------------------------------------

def step_seconds(cfg: Config, world_size: int, rates: GpuRates, kernel: str, args=None,
                 fused_norm: bool = True, fp32_loss: bool = False,
                 fused_forms: bool = True, free_at_peak: int | None = None,
                 swiglu: str | None = None, autograd_tiles: bool = False,
                 recompute_logits: bool = False, gradient_memory: str | None = None,
                 norm_outputs_kept: bool = False, offloaded_block_bytes: int = 0) -> dict:
    """Seconds of one optimizer step of `cfg` on `world_size` GPUs of `rates`, per term (their
    sum is the prediction), with attention `kernel` ("fa4", "cudnn", "flash"). fused_norm=False:
    the RMSNorms op by op, as the calibration rows so marked ran them; fp32_loss=True: the
    loss's cross-entropy with fp32 logits, as before base/fused.py's (the rows say so);
    fused_forms=False: SwiGLU and rotary op by op, as before base/fused.py or without the
    compiler (TORCHDYNAMO_DISABLE=1); swiglu (a row's marker, support/byte_counts.SWIGLU_KEPT)
    and autograd_tiles (04's tiles ran autograd): rows whose recompute ran down_proj again,
    the untiled MLP under 03 before SwiGLUDown skipped it, the tiled one before 04's
    hand-written backward (step_flops' recompute_down); recompute_logits: rows whose tiled
    loss computed its logits again in backward; gradient_memory: rows measured with FSDP2's own
    gradient allocation say "reduce-scatter stream" (predicted_retries); norm_outputs_kept:
    rows measured before 03 computed the norms' outputs of its unchecked blocks again (in
    backward, each a norm's forward and a copy: two thirds of a norm's forward + backward,
    by bytes). free_at_peak: the
    bytes the memory plan leaves usable at its peak (None: not known, no allocator term).
    offloaded_block_bytes: what one block of 07's sends to the host (the plan's
    host_parts["activations (07)"] over --offload-activations; 0: no copy term). A
    ValueError for an impossible layout (check_layout's)."""
    args = args or model_args(cfg)
    sp, ring, head_chunk = check_layout(cfg, world_size, args)
    if kernel not in rates.attention:
        raise ValueError(f"no attention rate for kernel {kernel!r} on this GPU")
    b = 2 if cfg.dtype == "bfloat16" else 4
    micro = cfg.grad_accum
    sequences = cfg.batch_size * (world_size // sp)
    n = cfg.batch_size * cfg.seq_len // sp  # local tokens of one micro-batch
    layers, width = args.n_layers, args.dim + args.ffn_dim
    # the rows measured before SwiGLUDown ran their untiled MLP whole in 03's recompute
    whole_mlp_recomputed = not cfg.tile_mlp and swiglu is not None
    flops = step_flops(args, cfg.seq_len, sequences, bool(cfg.keep_attention),
                       checkpoint=cfg.checkpoint, tile_mlp=cfg.tile_mlp, tile_loss=cfg.tile_loss,
                       checkpoint_layers=cfg.checkpoint_layers,
                       recompute_down=whole_mlp_recomputed or (cfg.tile_mlp and autograd_tiles),
                       recompute_logits=recompute_logits)
    recomputed = checkpointed_layers(cfg, layers) / layers  # the share of blocks run again
    attention_rate = rates.attention[kernel] * (RING_RATE if ring > 1 else 1)
    linear_s = flops["linear"] / world_size / rates.matmul
    attention_s = flops["attention"] / world_size / attention_rate
    passes = 3 + recomputed  # forward, backward (twice its work), 03's recompute
    layer_forward_s = (linear_s + attention_s) / passes / layers  # one block's forward
    # 03's recompute runs no MLP activation (SwiGLUDown and 04's tiles skip it there)
    recomputed_width = args.dim + args.ffn_dim * whole_mlp_recomputed
    norm_s = rates.norm_fused_s if fused_norm else rates.norm_op_by_op_s
    # each norm's forward + backward; a recompute is a third of that, 03's recompute_norms in
    # the blocks it leaves unchecked two thirds (a forward, and a copy of as many bytes)
    norm_runs = (2 * layers + 1) * (1 + (recomputed + cfg.tile_norm) / 3)
    if cfg.checkpoint and not norm_outputs_kept:
        norm_runs += 2 * layers * (1 - recomputed) * 2 / 3
    logit_bytes, recomputed_bytes = (FP32_LOGIT_BYTES if fp32_loss
                                     else (LOGIT_BYTES, RECOMPUTED_LOGIT_BYTES))
    seconds = {
        "linear layers": linear_s,
        "attention": attention_s,
        "elementwise": ((rates.elementwise_s if fused_forms else rates.elementwise_op_by_op_s)
                        * n * layers * (width * 3 + recomputed_width * recomputed)),
        "norms": norm_s * n * args.dim * norm_runs,
        "loss": n * args.vocab_size
                * (logit_bytes + recomputed_bytes * (cfg.tile_loss and recompute_logits))
                / rates.memory,
        "tiles (04)": tile_seconds(cfg, args, n, rates),
        "offload copies (03)": offload_seconds(cfg, args, n, b, rates, layer_forward_s),
        "activation copies (07)": activation_copy_seconds(cfg, offloaded_block_bytes, rates,
                                                          layer_forward_s),
        "exchanges (02)": exchange_seconds(cfg, args, n, sp // ring, b, rates),
        "stages (05)": (untied_seconds(args, n, head_chunk, sp // ring, rates)
                        if cfg.untied else 0),
    }
    seconds = {term: s * micro for term, s in seconds.items()}  # each micro-batch runs them
    seconds["allocator retries"] = (predicted_retries(cfg, args, world_size, free_at_peak,
                                                      gradient_memory)
                                    * rates.alloc_retry_s)  # a step's (measured: one batch)
    seconds["optimizer step"] = optimizer_seconds(cfg, args, world_size, rates, layer_forward_s)
    seconds["moment copies (09)"] = moment_copy_seconds(cfg, args, world_size, rates,
                                                        layer_forward_s, offloaded_block_bytes)
    seconds["collectives (01)"] = micro * collective_seconds(cfg, args, world_size, b, rates,
                                                             layer_forward_s)
    return seconds


def predicted_retries(cfg: Config, args, world_size: int, free_at_peak: int | None,
                      gradient_memory: str | None = None) -> int:
    """Retries of the caching allocator per step (support.progress.allocator_retries counts the
    measured ones), where a plan leaves less free at its peak than `allocator_headroom`.

    FSDP2's own allocation (with --offload-model-state, and in the rows measured before
    base/gradient_memory.py: gradient_memory="reduce-scatter stream") reduce-scatters into
    blocks of its own stream, which the caching allocator keeps for that stream alone: after a
    step the gradients sit in that cache (byte_counts.gradient_stream_cache_bytes), the forward
    runs out of fresh memory, the allocator gives every cached block back and tries again, and
    the backward's gradients do the same: two retries a step. Measured on one H200: Llama-3.2-3B
    at 32K, 6.8 GiB left by --stack 1 (2 retries), 15.6 by U = 24 and 20.1 by --tile-loss
    (none); Llama-3-8B, its gradients alone 29.9 GiB, twice at every depth of checkpointing.

    The gradients from the compute stream's memory (01's default since base/gradient_memory.py):
    that cache is gone (the A/B at 16K on Llama-3-8B: 3 retries a step with FSDP2's own
    allocation, 1 every other step without), and what is left is fragmentation: measured at
    bd79859, Llama-3-8B on one H200 retried about once a step where its plan left 0.5 to 6.7
    GiB free at its peak (16K with 8 and 9 of 32 blocks checkpointed, 32K with 19) and never
    with 6.5 to 11.2 (32K with 21, 16K with 10 and 12): FRAGMENTATION_BLOCKS, one retry."""
    headroom = allocator_headroom(cfg, args, world_size, gradient_memory)
    if free_at_peak is None or headroom is None or free_at_peak >= headroom:
        return 0
    return 2 if streams_cache(cfg, gradient_memory) else 1


FRAGMENTATION_BLOCKS = 17  # free at the peak below 17 blocks' gathered bf16 weights, a step
# retried once: Llama-3-8B's 6.9 GiB (measured on one H200: retries with 6.7 GiB free, none from
# 6.5, above); Llama-3.2-3B's 3.2 GiB (one H100, 16K and 32K: none with 5.8 and 3.7 GiB free).
# The largest allocations that recur are of a block's size, so the room they need scales with it.
# Two models set it (the 3B only from above): beyond 8B an extrapolation no GPU has checked.


def streams_cache(cfg: Config, gradient_memory: str | None) -> bool:
    """Whether FSDP2 allocates the reduced gradients on its own stream (its cache retries)."""
    return cfg.offload_model_state or gradient_memory == "reduce-scatter stream"


def allocator_headroom(cfg: Config, args, world_size: int,
                       gradient_memory: str | None = None) -> int | None:
    """The bytes a plan must leave free at its peak for the allocator never to retry: what
    FSDP2's reduce-scatter stream keeps cached where it allocates (predicted_retries), else
    FRAGMENTATION_BLOCKS of bf16 weights; None without FSDP."""
    if not cfg.fsdp:
        return None
    if not streams_cache(cfg, gradient_memory):
        return FRAGMENTATION_BLOCKS * 2 * byte_counts.block_params(args)  # bf16: 2 bytes a weight
    return byte_counts.gradient_stream_cache_bytes(args, world_size, cfg.offload_model_state)


def step_seconds_total(*arguments, **options) -> float:
    return sum(step_seconds(*arguments, **options).values())


# ---- 02_ulysses.py: the all-to-alls, which nothing overlaps ----------------------------------

def exchange_seconds(cfg: Config, args, n: int, ulysses: int, b: int, rates: GpuRates) -> float:
    """Per layer: q, k, v into the head layout and the output back in forward and in 03's
    recompute; the output's gradient in, dq, dk, dv out in backward. K/V heads are replicated up
    to the Ulysses degree. Each rank keeps 1/P of what it sends."""
    if ulysses == 1:
        return 0.0
    per_pass = (n * (2 * args.n_heads + 2 * max(args.n_kv_heads, ulysses)) * args.head_dim * b
                * (ulysses - 1) / ulysses)
    return args.n_layers * (2 + cfg.checkpoint) * per_pass / rates.all_to_all


# ---- 03_checkpoint_offload.py: the copies that no compute hides -----------------------------

def offload_seconds(cfg: Config, args, n: int, b: int, rates: GpuRates,
                    layer_forward_s: float) -> float:
    """Each checkpointed block's input but the last goes to the host during its block's forward
    and comes back during the backward of the block above (with --keep-attention its kept output
    and fp32 log-sum-exp too); a copy longer than the compute beside it shows. The backward's
    compute is about twice the forward's."""
    checkpointed = cfg.checkpoint_layers or args.n_layers  # the last of them stays on the GPU
    if not cfg.offload or checkpointed < 2:
        return 0.0
    nbytes = n * args.dim * b
    if cfg.keep_attention:
        nbytes += n * args.n_heads * (args.head_dim * b + 4)
    copy = nbytes / rates.pinned_copy
    shown = max(0.0, copy - layer_forward_s) + max(0.0, copy - 2 * layer_forward_s)
    return (checkpointed - 1) * shown


def activation_copy_seconds(cfg: Config, block_bytes: int, rates: GpuRates,
                            layer_forward_s: float) -> float:
    """07: an offloaded block's copy out has two blocks' forward before the compute stream
    waits for it (the top one's: the block above it), the copies one after another on one
    stream, and its copy back the backward of the kept block above it (about twice a block's
    forward): a longer copy shows. Not yet calibrated: no step with 07 has been measured on
    a GPU."""
    offloaded = cfg.offload_activations
    if not offloaded:
        return 0.0
    copy = block_bytes / rates.pinned_copy
    out = ((offloaded - 1) * max(0.0, copy - 2 * layer_forward_s)
           + max(0.0, copy - layer_forward_s))
    return out + offloaded * max(0.0, copy - 2 * layer_forward_s)


# ---- 04_alst_tiling.py: the fp32 weight-gradient sum of every tile -------------------------

def tile_seconds(cfg: Config, args, n: int, rates: GpuRates) -> float:
    """Each MLP tile adds its three weights' gradients into their fp32 sums; each loss tile
    lm_head's: memory-bound work per tile and weight value. Calibrated on steps measured while
    04 added a bf16 tile gradient to the sum (GRAD_SUM_BYTES); since its hand-written backward
    accumulates into the sum inside the matmul on CUDA (04's add_matmul), this over-counts a
    little (bench/grad_sums.py: the lm_head tile 3.22 ms for both against 4.70) until steps of
    the new code are calibrated."""
    seconds = 0.0
    if cfg.tile_mlp:
        tiles = -(-n // min(tiling.mlp_tile_size(args.dim, n, cfg.mlp_tile_tokens), n))
        seconds += args.n_layers * tiles * 3 * args.dim * args.ffn_dim * GRAD_SUM_BYTES
    if cfg.tile_loss:
        tiles = -(-n // min(tiling.loss_tile_size(args.vocab_size, n, cfg.loss_tile_tokens), n))
        seconds += tiles * args.vocab_size * args.dim * GRAD_SUM_BYTES
    return seconds / rates.memory


# ---- 05_untied_ulysses.py: H/U stages per layer --------------------------------------------

def untied_seconds(args, n: int, head_chunk: int, ulysses: int, rates: GpuRates) -> float:
    """What Untied Ulysses' stages cost beyond the work they share out: each stage exchanges its
    own q, output and gradients, smaller all-to-alls one after another, per token and layer.
    On one GPU (nothing exchanged) the stages measured no slower than one call over all heads
    (docs/calibration.md)."""
    if ulysses == 1:
        return 0.0
    return n * args.n_layers * rates.stage_s * (args.n_heads // head_chunk)


# ---- 01_fsdp.py: the optimizer step, on the GPU or on the host -----------------------------

def collective_seconds(cfg: Config, args, world_size: int, b: int, rates: GpuRates,
                       layer_forward_s: float) -> float:
    """One micro-batch's all-gathers and reduce-scatters of FSDP's units that the compute beside
    them does not hide. A block's weights are gathered in the compute dtype (`b` bytes) before
    its forward and again before its backward (the last block's stay gathered), and its fp32
    gradients reduce-scattered after its backward; a rank receives or sends (P-1)/P of each.
    FSDP2 gathers the next block while this one computes (its forward; a backward, taken as
    twice that, beside the next gather and the scatter of the block above, which share the
    links); what is longer than the compute beside it shows. Waited for: the root's gather
    (embeddings, final norm, lm_head) and block 0's before the first forward, block 0's scatter
    and the root's after the last backward. The rate: the all-to-all's, measured between 2
    H200s (NVLink); no all-gather was timed on its own. Not counted: with the model state on the
    host, the copies of each shard to the GPU before its gather and back after its scatter (the
    host AdamW's fitted constant took them where they showed)."""
    if not cfg.fsdp or world_size == 1:
        return 0.0
    share = (world_size - 1) / world_size
    block = byte_counts.block_params(args)
    root = model.num_params(args) - args.n_layers * block
    gather, scatter = (block * nbytes * share / rates.all_to_all for nbytes in (b, 4))
    later = args.n_layers - 1  # the blocks after block 0
    shown = (later * max(0.0, gather - layer_forward_s)
             + later * max(0.0, gather + scatter - 2 * layer_forward_s))
    return shown + gather + scatter + root * (b + 4) * share / rates.all_to_all


def optimizer_seconds(cfg: Config, args, world_size: int, rates: GpuRates,
                      layer_forward_s: float = 0.0) -> float:
    """The fused AdamW step and gradient clipping over this GPU's fp32 shard, memory-bound; with
    --offload-model-state on the host instead, on the rank's share of its cores (16 per GPU on
    the machines measured), with the clipping of host gradients and what the shards' copies
    between host and GPU leave uncovered. Without FSDP one process steps the compute-dtype
    state. With 08 (--overlap-optimizer) the forward waits for the root's update and block 0's;
    each later block's runs beside the blocks below it, shown by BESIDE_FORWARD_SHOWN where one
    block's update is shorter than one block's forward (`layer_forward_s`), and whole beyond."""
    n_params = model.num_params(args)
    per_param = ADAMW_BYTES + CLIP_BYTES * (cfg.grad_clip > 0)
    if cfg.offload_model_state:
        return n_params / world_size * rates.host_adamw_s
    per_second = (world_size if cfg.fsdp else 2) * rates.memory  # parameters' bytes a second
    whole = n_params * per_param / per_second
    if not cfg.overlap_optimizer:
        return whole
    layers = args.n_layers
    # one block's update
    block = byte_counts.block_params(args) * (per_param - NORM_BYTES) / per_second
    # waited for: the clip's norm (on the compute stream, before), the root's update and block 0's
    first = whole - (layers - 1) * block
    beside = min(block, layer_forward_s)
    return first + (layers - 1) * (BESIDE_FORWARD_SHOWN * beside + block - beside)


# ---- 09_offload_moments.py: the moments' copies beside the forward ----------------------------

def moment_copy_seconds(cfg: Config, args, world_size: int, rates: GpuRates,
                        layer_forward_s: float, offloaded_block_bytes: int = 0) -> float:
    """09: each block's moments come in for its update (08's, beside the forward of the blocks
    below it) and go back, one copy engine each way. The forward waits for block 0's copy in;
    after that the copies keep pace where one block's is shorter than one block's forward, and
    each block's forward waits the difference where it is longer. 07's copies out, in the same
    forward, share the engine out. BOTH_WAYS measured on one H100; on one H200 Llama-3-8B at
    32K with 09 came within 1.8% (peers_llama3-8b_1gpu_auto_32k_fa4_3bd274d.json)."""
    if not cfg.offload_moments:
        return 0.0
    block = byte_counts.streamed_moment_bytes(args, world_size, cfg.fsdp,
                                              2 if cfg.dtype == "bfloat16" else 4)
    rate = rates.pinned_copy * BOTH_WAYS  # (the two copies of one block run at once)
    copy_in = block["block"] / rate
    out_bytes = block["block"] + offloaded_block_bytes * cfg.offload_activations / args.n_layers
    per_block = max(copy_in, out_bytes / rate)
    return copy_in + (args.n_layers - 1) * max(0.0, per_block - layer_forward_s)
