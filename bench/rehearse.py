"""Rehearse one rank of an N-GPU training step on one GPU: rank r of N in one process.

    python -m bench.rehearse --gpus 8 --gpu-mem 80GiB --model llama3-8b --stack 5 \\
        --seq-lens 3M 4M 5M
    python -m bench.rehearse --gpus 8 --stack 5 --longest                # the planner's longest
    python -m bench.rehearse --gpus 8 --stack 5 --compare-window 512K    # full kernel vs window
    python -m bench.rehearse --gpus 8 --stack 5 --window 0 --seq-lens 1M # rank 0's compute time
    python -m bench.rehearse --gpus 8 --stack 5 --seq-lens 3M --then --ring 2 --longest \\
        --then --gpus 16 --ring 2 --longest    # several rehearsals, one process, JSON after each
    python -m bench.rehearse --device cpu --model tiny --gpus 8 --stack 5 --seq-lens 1K

Method. PyTorch's fake process group (`init_process_group("fake")`, torch.testing's FakeStore)
makes this process rank r of N with no other process: every collective completes at once (an
all-gather copies the local input into each chunk; all-to-all, reduce-scatter, all-reduce and
the ring's sends and receives leave their outputs as they were allocated). The process then runs
rank r's own part of the N-rank step: the same shapes, allocations and kernels. The step is the
project's own, unchanged: train.build_model and train.make_optimizer through bench.max_length's
trial (the missing layers' model state as ballast, Adam's moments allocated), then train.py's
forward_backward and the optimizer step as train.train_step runs them, less the raise of its
finite check (the values are garbage by design; AdamW's kernel still skips its update where they
are not finite, which allocates nothing). The allocator
is capped at the rehearsed GPU's memory less what a real rank loses outside PyTorch
(`torch.cuda.set_per_process_memory_fraction`), so a step that would not fit that GPU runs out
of memory here too.

Depth: 2 layers by default, and the missing layers stand above them. Their parameters and Adam
moments are ballast from the start; their gradients (on the GPU) are allocated when the
backward reaches the top block, as full depth has made them by then, and freed with the
others after the optimizer step. Through the top block's backward the block above it, missing,
would still hold its reduce-scatter input (FSDP2 frees it when the next block's reduce-scatter
starts: one layer's gradients unsharded in fp32, 0.81 GiB for Llama-3-8B, whatever N): that too
is allocated then, and freed when the top block's backward is done. So the top block's backward
is full depth's layer 1: its
input and the prefetched input of the block below (03's offload), with 30 layers' gradients;
and the bottom block's is full depth's layer 0 (one input, 31 layers' gradients). Layer 1's
moment is the larger whenever a block input outweighs one layer's gradients (Llama-3-8B: S/N
tokens x 8 KiB against 4 bytes x 218M / N, from S = 106K on, whatever N). --layers 1 gives
bench.max_length's depth (layer 0's moment only); with --offload-model-state the gradients are
on the host (ballast there, or none with --no-host-ballast) and 2 layers are what
bench.max_length uses.

Where it peaked: hooks on the blocks and the step's phases mark moments (forward of each layer,
the loss, backward of each layer and within it of its MLP, its post-attention RMSNorm, its
attention and its input RMSNorm, as the planner names them; the optimizer step with its
gradient clip); at each mark the
allocator's peak since the last one is read and reset, so every moment has its own peak. On the
CPU the process's resident set (VmHWM, reset through /proc/self/clear_refs) stands in for it:
tensors plus the interpreter's own memory, a rough figure.

The cheap kernel (--window W, default 256 with FlashAttention-4 on a GPU): at millions of
tokens rank r's attention takes minutes per layer. FlashAttention-4's two entry points
(flash_attn.cute.flash_attn_func and flash_attn.cute.interface._flash_attn_bwd, which
base/kernels.py and FA4's own autograd look up at call time) are wrapped in this process
only so that every call attends over a causal local window of W keys: the output, the
log-sum-exp and the backward's workspace keep their shapes, the work drops from S^2 to S x W.
`--compare-window LEN` runs one length with both kernels and records both peaks (equal is the
claim). --window 0: the full kernel, whose step time is rank r's compute time.

What is real: rank r's allocations (every tensor of its build, step and optimizer, in the real
allocator with its fragmentation, under the rehearsed GPU's cap), the kernels it launches and
their shapes, its compute time with the full kernel, and the bytes it hands to each collective.
What is not: the values (exchanged buffers hold garbage); communication time (collectives
complete at once: no waiting, no overlap); NCCL's own buffers and the CUDA context of the
rehearsed GPU (outside PyTorch's allocator: taken off the cap, --outside-allocator); the
missing layers' host memory (offloaded checkpoints, and with --offload-model-state their model
state unless host ballast holds it; the planner counts them) and their compute; the other ranks
(rank 0 stands for all where the layout is symmetric: FSDP's uneven shards give rank 0 the
most). The JSON says this in its "real" and "not_real" lists.
"""

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib
import inspect
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from model import PRESETS, get_model_args
import plan as planner
from bench import max_length
from bench.report import claim_result, release, synchronize, write_result
from base import checkpointed, kernels
from support import byte_counts
from support.data import parse_tokens
from support.runtime import check_layout
from support.errors import out_of_memory_names
from support.config import Config, learning_rate, model_args

train = importlib.import_module("train")
GiB = 2**30

REAL = [
    ("rank r's allocations: every tensor of its build, step and optimizer step, in PyTorch's "
     "allocator (its fragmentation included), capped at the rehearsed GPU's memory"),
    ("the kernels rank r launches and their shapes (attention over a local window of `window` "
     "keys where window > 0: the same allocations, less work)"),
    "rank r's compute time with window 0 (step_time_s: collectives return at once)",
    "the bytes rank r hands to each collective (sent_bytes)",
    ("the missing layers' model state as ballast (bench.max_length): on the GPU, or on the host "
     "with --offload-model-state unless --no-host-ballast"),
]
NOT_REAL = [
    ("values: every exchanged buffer holds garbage (the loss and gradients mean nothing; the "
     "finite check raises nothing in this script's step; AdamW skips its update where they are "
     "not finite)"),
    "communication time: every collective completes at once (no waiting, no overlap)",
    ("NCCL's own buffers and the rehearsed GPU's CUDA context: outside PyTorch's allocator, "
     "taken off the cap (outside_allocator_gib)"),
    ("host memory of the missing layers (offloaded checkpoints; their model state with "
     "--offload-model-state when no host ballast): the planner counts it "
     "(full_depth_host_gib_per_gpu)"),
    "the missing layers' compute time, and every other rank",
]


# ---------------------------------------------------------------------------------------------
# The fake group, the memory cap, the cheap kernel: this process only, for a rehearsal only.
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_group(world: int, rank: int):
    """This process as rank `rank` of `world` ranks that do not exist, within the block only:
    the group is destroyed on the way out, so nothing after it can use it."""
    if dist.is_initialized():
        raise RuntimeError("a process group exists already: a rehearsal's fake group must be "
                           "the only group of its process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cap_allocator(device: torch.device, gpu_mem: int, outside: int) -> dict:
    """Cap PyTorch's allocator at what a rank on the rehearsed GPU could have: its memory less
    what lives outside the allocator there (CUDA context, NCCL). A GPU rehearsing itself (as
    much memory as it has, to within 0.5%) is not capped: its own context is real."""
    total = torch.cuda.get_device_properties(device).total_memory
    if gpu_mem >= 0.995 * total:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        return {"cap_gib": total / GiB, "this_gpu_gib": total / GiB, "capped": False,
                "note": "the rehearsed GPU is this one: no cap, its context is real"}
    cap = gpu_mem - outside
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return {"cap_gib": cap / GiB, "this_gpu_gib": total / GiB, "capped": True}


def _bind(function, args, kwargs) -> inspect.BoundArguments:
    return inspect.signature(function).bind(*args, **kwargs)


@contextlib.contextmanager
def windowed_attention(window: int):
    """Within: every FlashAttention-4 forward and backward of this process attends over a
    causal local window of `window` keys, whatever it was asked (window 0: unchanged). The
    arguments are rebound by name, so a caller that already passes a window (FA4's autograd
    backward passes the forward's) gets it replaced, not duplicated."""
    if not window:
        yield
        return
    import flash_attn.cute as fa4
    from flash_attn.cute import interface

    full_forward, full_backward = fa4.flash_attn_func, interface._flash_attn_bwd

    def forward(*args, **kwargs):
        call = _bind(full_forward, args, kwargs)
        call.arguments.update(causal=True, window_size=(window, 0))
        return full_forward(*call.args, **call.kwargs)

    def backward(*args, **kwargs):
        call = _bind(full_backward, args, kwargs)
        call.arguments.update(causal=True, window_size_left=window, window_size_right=0)
        return full_backward(*call.args, **call.kwargs)

    # FA4 keeps its compiled kernels on the functions themselves (`_flash_attn_bwd.compile_cache`,
    # read through the module global that is patched here): the wrappers carry those attributes.
    functools.update_wrapper(forward, full_forward)
    functools.update_wrapper(backward, full_backward)
    patched = [(fa4, "flash_attn_func", forward), (interface, "_flash_attn_bwd", backward)]
    if getattr(interface, "flash_attn_func", None) is full_forward:
        patched.append((interface, "flash_attn_func", forward))
    with replaced(patched):
        yield


@contextlib.contextmanager
def replaced(attributes):
    """Within: each (module, name, replacement) in place; the originals back on the way out
    (unittest.mock's patch.object, one per attribute)."""
    with contextlib.ExitStack() as stack:
        for module, name, replacement in attributes:
            stack.enter_context(mock.patch.object(module, name, replacement))
        yield


# ---------------------------------------------------------------------------------------------
# What the step shows of itself: its memory by moment, the bytes it hands to collectives.
# ---------------------------------------------------------------------------------------------

def _process_memory() -> tuple:
    """(resident bytes now, peak resident bytes) of this process (Linux), else (None, None)."""
    try:
        fields = dict(line.split(":", 1)
                      for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None, None


def _reset_process_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS
    except OSError:
        pass


class PeakTrace:
    """The step's memory by moment: `mark(name)` closes the moment before (its peak) and opens
    `name`. On a GPU the allocator's peak is reset at every mark, so each moment has its own;
    on the CPU the process's peak resident set stands in (module docstring)."""

    def __init__(self, device: torch.device):
        self.device, self.moments, self.current = device, [], None
        self.lock = threading.Lock()  # backward's hooks run on autograd's thread

    def _now(self) -> tuple:
        if self.device.type == "cuda":
            return (torch.cuda.memory_allocated(self.device),
                    torch.cuda.max_memory_allocated(self.device),
                    torch.cuda.max_memory_reserved(self.device))
        now, peak = _process_memory()
        return now, peak, None

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_process_peak()

    def mark(self, moment: str | None) -> None:
        with self.lock:
            now, peak, reserved = self._now()
            if self.current is not None:
                self.moments.append({"moment": self.current, "start_gib": _gib(self.start),
                                     "peak_gib": _gib(peak), "peak_reserved_gib": _gib(reserved),
                                     "peak_bytes": peak})
            self.current, self.start = moment, now
            self._reset()

    @contextlib.contextmanager
    def phase(self, name: str):
        """02's `phase`: a moment, and train.py's out-of-memory error naming it."""
        self.mark({"forward": "forward: embedding",
                   "backward": "backward: loss and head"}.get(name, name))
        with out_of_memory_names(name):
            yield

    def summary(self) -> dict:
        """The step's peak (the largest moment's), where it was, and every moment."""
        known = [m for m in self.moments if m["peak_bytes"] is not None]
        if not known:
            return {"moments": self.moments}
        top = max(known, key=lambda m: m["peak_bytes"])
        reserved = [m["peak_reserved_gib"] for m in known if m["peak_reserved_gib"] is not None]
        return {"peak_bytes": top["peak_bytes"], "peak_gib": top["peak_gib"],
                "peak_at": top["moment"],
                **({"peak_reserved_gib": max(reserved)} if reserved else {}),
                "moments": self.moments}


def _gib(nbytes):
    return None if nbytes is None else round(nbytes / GiB, 4)


# A block's parts in the order its backward reaches them (the planner's names for the moments
# of a block's backward: "its MLP", "its post-attention RMSNorm", "its attention").
BLOCK_PARTS = (("mlp", "its MLP"), ("post_attention_layernorm", "its post-attention RMSNorm"),
               ("self_attn", "its attention"), ("input_layernorm", "its input RMSNorm"))


@contextlib.contextmanager
def layer_marks(model, trace: PeakTrace, top_backward=lambda: None, top_done=lambda: None):
    """Marks at each block's forward, after the last one (the final norm and the loss), and in
    backward when the gradient of a block's output, then of each of its parts' outputs, arrives
    (as support/progress.py's bars count them; 03's recompute in backward is not marked: the
    block's own runs its inner forward, and the parts' are skipped while 03 says it recomputes;
    it happens within the block's first part, its MLP). top_backward() runs when the backward
    reaches the top block, before its mark; top_done() when the top block's backward is done
    (the gradient of the block below's output arrives; with one block, the step marks it)."""
    layers, hooks = len(model.layers), []

    def when_grad_arrives(moment, before=lambda: None):
        def arrived(_grad):
            before()
            trace.mark(moment)

        def forward_hook(_module, _inputs, output):
            if (torch.is_tensor(output) and output.requires_grad
                    and not checkpointed.is_recomputing()):
                output.register_hook(arrived)
        return forward_hook

    for i, block in enumerate(model.layers):
        name = f"layer {i} of {layers}"
        hooks.append(block.register_forward_pre_hook(
            lambda *_, name=name: trace.mark(f"forward of {name}")))
        if i == layers - 1:
            hooks.append(block.register_forward_hook(
                lambda *_: trace.mark("forward: final norm and loss")))
        arrived = {layers - 1: top_backward, layers - 2: top_done}.get(i, lambda: None)
        hooks.append(block.register_forward_hook(when_grad_arrives(f"backward of {name}",
                                                                   arrived)))
        for part, label in BLOCK_PARTS:
            if isinstance(getattr(block, part, None), torch.nn.Module):
                hooks.append(getattr(block, part).register_forward_hook(
                    when_grad_arrives(f"backward of {name}: {label}")))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


# How many bytes leave a rank per collective, by the input each call is given (P: the group's
# ranks; NCCL's ring algorithms): an all-to-all sends all but its own piece, an all-gather its
# input to P - 1 ranks, a reduce-scatter (P-1)/P of its input, an all-reduce twice that; a ring
# pass its tensors. Functional collectives (DTensor's, in gradient clipping: a scalar) not counted.
# torch.distributed function -> (kind, the argument sent, sent bytes per input byte)
COLLECTIVES = {
    "all_to_all_single": ("all-to-all", "input", lambda p: (p - 1) / p),
    "all_gather_into_tensor": ("all-gather", "input_tensor", lambda p: p - 1),
    "all_gather_single": ("all-gather", "input_tensor", lambda p: p - 1),
    "reduce_scatter_tensor": ("reduce-scatter", "input", lambda p: (p - 1) / p),
    "reduce_scatter_single": ("reduce-scatter", "input", lambda p: (p - 1) / p),
    "all_reduce": ("all-reduce", "tensor", lambda p: 2 * (p - 1) / p),
}


class Traffic:
    """Counts, per kind, the calls and bytes this rank hands to torch.distributed during
    `counting()` (the collectives' module functions wrapped in this process, that block only)."""

    def __init__(self):
        self.kinds, self.depth = {}, threading.local()

    def add(self, kind: str, tensor_bytes: int, sent: float) -> None:
        count = self.kinds.setdefault(kind, {"calls": 0, "tensor_bytes": 0, "sent_bytes": 0})
        count["calls"] += 1
        count["tensor_bytes"] += tensor_bytes
        count["sent_bytes"] += int(sent)

    def _wrap(self, name, original):
        kind, argument, ratio = COLLECTIVES.get(name, ("ring P2P", None, None))

        def counted(*args, **kwargs):
            outermost = not getattr(self.depth, "inside", False)
            if outermost:
                call = _bind(original, args, kwargs)
                if name == "batch_isend_irecv":
                    sends = [op.tensor for op in call.arguments["p2p_op_list"]
                             if getattr(op.op, "__name__", "") == "isend"]
                    self.add(kind, sum(t.nbytes for t in sends), sum(t.nbytes for t in sends))
                else:
                    tensor = call.arguments[argument]
                    ranks = dist.get_world_size(call.arguments.get("group"))
                    self.add(kind, tensor.nbytes, tensor.nbytes * ratio(ranks))
            self.depth.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self.depth.inside = not outermost

        return counted

    @contextlib.contextmanager
    def counting(self):
        from torch.distributed import distributed_c10d

        patched = []
        for name in [*COLLECTIVES, "batch_isend_irecv"]:
            original = getattr(dist, name, None)
            if original is None:  # not in this torch
                continue
            wrapper = self._wrap(name, original)
            patched += [(module, name, wrapper) for module in (dist, distributed_c10d)
                        if getattr(module, name, None) is original]
        with replaced(patched):
            yield


# ---------------------------------------------------------------------------------------------
# The step: train.train_step's, through its forward_backward, without the finite check's raise.
# ---------------------------------------------------------------------------------------------

def rehearsal_step(model, optimizer, tokens, rt, cfg, trace: PeakTrace, traffic: Traffic,
                   window: int, late_gradient_bytes: int = 0, pending_reduce_bytes: int = 0
                   ) -> None:
    """train.train_step's step (learning rate, forward and backward, AdamW with the clip)
    with its moments marked, its collectives counted and attention over `window` keys; its
    finite check raises nothing: the values are garbage by design. late_gradient_bytes: the
    missing layers' gradients, allocated when the backward reaches the top block (at full
    depth the layers above it have made theirs by then) and held through the optimizer step.
    pending_reduce_bytes: the reduce-scatter input of the missing block above the top one,
    held from the top block's backward until that backward is done."""
    if window:  # the kernel check compares with the full formula: run it before the window
        probe = torch.empty(1, 1, 1, model.args.head_dim, device=rt.device,
                            dtype=getattr(torch, cfg.dtype))
        kernel = kernels.lse_kernel(probe)[0]
        if kernel != "fa4":
            raise ValueError(f"--window {window} cuts FlashAttention-4's work, but attention runs "
                             f"{kernel} here; --window 0 runs the full kernel")
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, 0)
    late_gradients = []

    pending_reduce = []

    def allocate_late_gradients():  # on a GPU: a CPU run holds no ballast (bench.max_length)
        if late_gradient_bytes and rt.device.type == "cuda":
            late_gradients.append(torch.empty(late_gradient_bytes, dtype=torch.uint8,
                                              device=rt.device))
        if pending_reduce_bytes and rt.device.type == "cuda":
            pending_reduce.append(torch.empty(pending_reduce_bytes, dtype=torch.uint8,
                                              device=rt.device))

    def free_pending_reduce():  # the top block's post-backward takes its reduce-scatter's place
        pending_reduce.clear()

    with (layer_marks(model, trace, allocate_late_gradients, free_pending_reduce),
          windowed_attention(window), traffic.counting()):
        loss = train.forward_backward(model, tokens, rt, phase=trace.phase)
        free_pending_reduce()  # one block: its own post-backward, at the end of backward
        trace.mark("optimizer step")  # the clip's norm, then AdamW scaling by it as it steps
        train.clipped_step(model, optimizer, loss, cfg.grad_clip)
        late_gradients.clear()  # as zero_grad frees the gradients of full depth
        trace.mark("after the step")
        trace.mark(None)


# ---------------------------------------------------------------------------------------------
# One rehearsal (a configuration on N GPUs): its Config, the planner's view, its rows.
# ---------------------------------------------------------------------------------------------

def train_args(opts, seq_len: int, head_chunk: int | None) -> list:
    """train.py's flags for this configuration at full depth (what the planner is given, and
    what a calibration row records)."""
    flags = ["--model", opts.model, "--seq-len", str(seq_len), "--stack", str(opts.stack)]
    flags += ["--ring", str(opts.ring)] if opts.ring else []
    flags += ["--head-chunk", str(head_chunk)] if head_chunk else []
    flags += ["--offload-model-state"] if opts.offload_model_state else []
    flags += ["--keep-attention" if opts.keep_attention else "--no-keep-attention"]
    flags += ["--attn-kernel", opts.attn_kernel] if opts.attn_kernel != "auto" else []
    return flags


def full_config(opts, seq_len: int, head_chunk: int | None = None) -> Config:
    """The full-depth Config the planner reads (train.parse_args of `train_args`)."""
    dtype = "bfloat16" if opts.device == "cuda" else "float32"
    return train.parse_args(train_args(opts, seq_len, head_chunk)
                            + ["--dtype", dtype, "--device", opts.device])


def choose_head_chunk(opts, seq_len: int) -> int | None:
    """05's head chunk U: --head-chunk, else on a GPU train.py's choice for the rehearsed GPU
    (the fewest stages whose plan fits it), else U = P/R (the least memory)."""
    cfg = full_config(opts, seq_len)
    if not cfg.untied:
        return None
    if opts.head_chunk:
        return opts.head_chunk
    if opts.device == "cuda":
        return planner.fewest_stages_that_fit(cfg, opts.gpus, opts.gpu_mem_bytes)
    return check_layout(cfg, opts.gpus, model_args(cfg))[2]


def base_config(opts) -> Config:
    """bench.max_length's base Config for `trial`: the techniques of --stack, one step; the
    seam (02 or 05) comes from the method string (`method_of`)."""
    cfg = full_config(opts, 1024 * opts.gpus * 2)
    return dataclasses.replace(cfg, stack=None, steps=1, head_chunk=None, seq_len=None)


def method_of(opts, head_chunk: int | None) -> str:
    """bench.throughput's method string for bench.max_length's trial."""
    cfg = full_config(opts, 1024 * opts.gpus * 2)
    name = "untied" if cfg.untied else "ulysses" if cfg.ulysses else "none"
    return (name + (f":{head_chunk}" if head_chunk else "")
            + (f"@{opts.attn_kernel}" if opts.attn_kernel != "auto" else ""))


def rehearse_length(opts, seq_len: int, window: int, head_chunk_of: int | None = None) -> dict:
    """One row: rank r's step at `seq_len` (bench.max_length's trial with this script's step),
    with its moments, its collectives' bytes and the planner's peak for the same configuration.
    head_chunk_of: a length whose head chunk to use (the warm-up's: the first row's)."""
    head_chunk = choose_head_chunk(opts, head_chunk_of or seq_len)
    device = (torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda"
              else torch.device("cpu"))
    trace, traffic = PeakTrace(device), Traffic()
    # The missing layers' gradients wait on the GPU (not with the model state on the host) for
    # the moment full depth makes them: allocated by the step, not as ballast before it.
    args = get_model_args(opts.model)
    late = 0 if opts.offload_model_state else max_length.ballast_bytes(
        args, opts.layers, opts.gpus)["gradients"]
    # And the block above the top one, missing here, would still hold its reduce-scatter input
    # (its unsharded gradients in fp32) through the top block's backward (byte_counts'
    # fsdp_buffer_bytes, "below_the_top"): allocated and freed as FSDP2 would.
    block = byte_counts.block_params(args)
    pending = byte_counts.REDUCE_BYTES * block if opts.layers < args.n_layers else 0

    def step(model, optimizer, tokens, rt, cfg):
        rehearsal_step(model, optimizer, tokens, rt, cfg, trace, traffic, window, late, pending)

    row = max_length.trial(base_config(opts), method_of(opts, head_chunk), seq_len, opts.layers,
                           run_step=step, host_ballast=opts.host_ballast,
                           ballast_parts=(None if opts.offload_model_state
                                          else ("parameters", "optimizer")))
    row["late_gradient_ballast_gib"] = late / GiB
    row["pending_reduce_scatter_gib"] = pending / GiB
    if trace.current is not None:  # out of memory inside this moment
        row["oom_in"] = trace.current
        trace.mark(None)
    summary = trace.summary()
    row.pop("peak_gib", None)  # the allocator's peak was reset at every moment: the moments' max
    row.update(rank=opts.rank, gpus=opts.gpus, layers=opts.layers, window=window,
               peak_kind=("GPU: PyTorch's allocated bytes" if device.type == "cuda"
                          else "CPU: the process's peak resident set (rough)"),
               **summary, sent_bytes=traffic.kinds)
    if row.get("step_time_s") is not None:
        row["step_time_note"] = ("rank r's compute time: collectives complete at once" if not window
                                 else f"attention over {window}-key windows: not a step's time")
    cfg = full_config(opts, seq_len, head_chunk)
    plan = planner.plan_memory(cfg, opts.gpus)
    row.update(train_args=train_args(opts, seq_len, head_chunk),
               planned_peak_gib=round(plan["peak"] / GiB, 4),
               planned_peak_at=planner.plan_peak_text(plan),
               planned_moments_gib={moment: round(sum(parts.values()) / GiB, 4)
                                    for moment, parts in plan["moments"].items()},
               planned_kernel=planner.planned_kernel(cfg),
               planned_fits=planner.fits_on_gpu(plan["peak"], opts.gpu_mem_bytes))
    measured = row.get("peak_bytes") if row["status"] == "completed" else None
    if measured:
        row["plan_error"] = round((plan["peak"] - measured) / measured, 4)  # > 0: planned high
    return row


def rehearse(opts, result: dict, save, started: float) -> None:
    """One configuration's rows (fixed lengths, the window comparison, the search), in the
    fake group of --gpus ranks; `save()` after every row."""
    run = {"flags": opts.flags, "gpus": opts.gpus, "rank": opts.rank, "model": opts.model,
           "stack": opts.stack, "ring": opts.ring, "offload_model_state": opts.offload_model_state,
           "keep_attention": opts.keep_attention, "layers": opts.layers, "window": opts.window,
           "host_ballast": opts.host_ballast, "gpu_mem_gib": opts.gpu_mem_bytes / GiB,
           "rows": []}
    result["runs"].append(run)
    longest_cfg = full_config(opts, opts.gpus * 2048)
    gpu_longest, _ = planner.plan_longest_seq_len(longest_cfg, opts.gpus, opts.gpu_mem_bytes, 2**60)
    host_longest, host_plan = planner.plan_longest_seq_len(longest_cfg, opts.gpus,
                                                           opts.gpu_mem_bytes, opts.host_mem_bytes)
    run["planner_longest"] = {"gpu_only": gpu_longest, "with_host_mem": host_longest,
                              "host_mem_gib": opts.host_mem_bytes / GiB,
                              "limit": host_plan["limit"] if host_plan else None}
    if time.perf_counter() - started >= opts.budget_s:
        run["skipped"] = "--budget-s spent before it"
        save()
        return
    device = (torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda"
              else torch.device("cpu"))
    if device.type == "cuda":
        run["allocator"] = {**cap_allocator(device, opts.gpu_mem_bytes, opts.outside_bytes),
                            "outside_allocator_gib": opts.outside_bytes / GiB,
                            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    save()

    def room_for(seq_len: int, window: int) -> bool:
        """Whether the row would end within --budget-s, as the last completed row with the same
        kernel says: its time x the length ratio squared (full kernel) or the ratio (window)."""
        done = [r for r in run["rows"] if r.get("status") == "completed" and r["window"] == window]
        expected = 0.0
        if done:
            power = 1 if window else 2
            expected = done[-1]["trial_s"] * (seq_len / done[-1]["seq_len"]) ** power
        return time.perf_counter() - started + expected < opts.budget_s

    def add(row):
        run["rows"].append(row)
        print({k: row.get(k) for k in ("seq_len", "window", "status", "peak_gib", "peak_at",
                                       "planned_peak_gib", "plan_error", "step_time_s")},
              flush=True)
        save()

    with fake_group(opts.gpus, opts.rank):
        first = (opts.compare_window or (opts.seq_lens or [0])[0]
                 or opts.first_length or gpu_longest or opts.granularity)
        if opts.warmup and device.type == "cuda":  # FA4 compiles its kernels at the first call
            warm = opts.gpus * 2048  # the shortest length whole K-token shards and 2R chunks take
            for window in sorted({opts.window, 0 if opts.compare_window else opts.window}):
                begun = time.perf_counter()
                rehearse_length(opts, warm, window, head_chunk_of=first)
                run.setdefault("warmup", []).append({"seq_len": warm, "window": window,
                                                     "s": time.perf_counter() - begun})
        if opts.compare_window:
            length = opts.compare_window
            rows = []
            for window in (0, opts.window):
                if not room_for(length, window):
                    break
                rows.append(rehearse_length(opts, length, window))
                add(rows[-1])
            if len(rows) == 2 and all(r.get("peak_bytes") for r in rows):
                full_peak, cut_peak = rows[0]["peak_bytes"], rows[1]["peak_bytes"]
                run["window_check"] = {"seq_len": length, "window": opts.window,
                                       "full_kernel_peak_bytes": full_peak,
                                       "windowed_peak_bytes": cut_peak,
                                       "difference_bytes": cut_peak - full_peak,
                                       "equal": cut_peak == full_peak,
                                       "within_2mib": abs(cut_peak - full_peak) <= 2**21,
                                       "moments_difference_bytes": {
                                           full["moment"]: cut["peak_bytes"] - full["peak_bytes"]
                                           for full, cut in zip(rows[0]["moments"],
                                                                rows[1]["moments"])
                                           if full["moment"] == cut["moment"]}}
                save()
        for length in opts.seq_lens:
            if not room_for(length, opts.window):
                add({"seq_len": length, "window": opts.window, "status": "skipped (budget)"})
                continue
            add(rehearse_length(opts, length, opts.window))
        if opts.longest:
            start = opts.first_length or gpu_longest or opts.granularity
            fits, fails, _ = max_length.search(
                None, None, start, opts.granularity, 0.1, opts.layers, opts.max_trials,
                in_budget=lambda length, trials: room_for(length, opts.window),
                after_trial=lambda fits, fails, trials: add(trials[-1]),
                run_trial=lambda _base, _method, length, _layers, _forward: rehearse_length(
                    opts, length, opts.window))
            run["longest"] = {"longest_completed": fits, "shortest_oom": fails,
                              "planner_longest": gpu_longest, "granularity": opts.granularity}
            save()


# ---------------------------------------------------------------------------------------------
# The command line: one rehearsal from the flags, more after each --then.
# ---------------------------------------------------------------------------------------------

WHAT_TO_RUN = ("seq_lens", "longest", "compare_window")
THEN = "--then"  # starts the next rehearsal's flags
PROCESS_FLAGS = ("device", "budget_s", "name", "out")


def make_parser(suppress: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog=f"{THEN} FLAGS: one more rehearsal (module docstring)",
                                     argument_default=argparse.SUPPRESS if suppress else None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default = lambda value: argparse.SUPPRESS if suppress else value
    parser.add_argument("--gpus", type=int, default=default(8), help="N: the job's GPUs")
    parser.add_argument("--rank", type=int, default=default(0), help="the rank rehearsed")
    parser.add_argument("--gpu-mem", default=default("80GiB"),
                        help="the rehearsed GPU's memory, as plan.py --gpu-mem (default 80GiB, "
                             "an H100's; 139.8GiB: an H200's, which this one rehearses uncapped)")
    parser.add_argument("--outside-allocator", default=default("1GiB"),
                        help="what a real rank's GPU loses outside PyTorch's allocator (CUDA "
                             "context, NCCL's buffers): the cap is --gpu-mem less this")
    parser.add_argument("--host-mem", default=default(planner.DEFAULT_HOST_MEM),
                        help="per node, for the planner's longest length (recorded)")
    parser.add_argument("--model", default=default("llama3-8b"))
    parser.add_argument("--stack", type=int, default=default(5))
    parser.add_argument("--ring", type=int, default=default(None))
    parser.add_argument("--head-chunk", type=int, default=default(None),
                        help="05's U (default: train.py's choice for the rehearsed GPU)")
    parser.add_argument("--offload-model-state", action=argparse.BooleanOptionalAction,
                        default=default(False), help="01's --offload-model-state")
    parser.add_argument("--keep-attention", action=argparse.BooleanOptionalAction,
                        default=default(False), help="03's --keep-attention (default off)")
    parser.add_argument("--attn-kernel", choices=kernels.KERNELS, default=default("auto"))
    parser.add_argument("--layers", type=int, default=default(2),
                        help="depth (default 2: the top block's backward is full depth's layer "
                             "1: two block inputs on the GPU and the layers above's gradients)")
    parser.add_argument("--host-ballast", action=argparse.BooleanOptionalAction,
                        default=default(True),
                        help="with --offload-model-state, the missing layers' state on the host "
                             "(--no-host-ballast: one GPU whose host cannot hold it; the GPU "
                             "peak needs none)")
    parser.add_argument("--window", type=int, default=default(None),
                        help="attention over a local window of W keys (FA4; default 256 with "
                             "FA4 on a GPU, else 0 = the full kernel)")
    parser.add_argument("--seq-lens", nargs="*", default=default([]), help="fixed lengths: 3M 4M")
    parser.add_argument("--longest", action="store_true", default=default(False),
                        help="bench.max_length's search, from the planner's longest")
    parser.add_argument("--first-length", default=default(None), help="--longest's first trial")
    parser.add_argument("--granularity", default=default("64K"))
    parser.add_argument("--max-trials", type=int, default=default(4))
    parser.add_argument("--compare-window", default=default(None), metavar="LEN",
                        help="one length with the full kernel and with --window: both peaks")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", default=default(True),
                        help="skip the short step that compiles the kernels first (GPU)")
    # The process's own flags (PROCESS_FLAGS): for every rehearsal, wherever they are given.
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default=default("cuda" if torch.cuda.is_available() else "cpu"))
    parser.add_argument("--budget-s", type=float, default=default(540),
                        help="no row starts that the last one's time says would not end in it")
    parser.add_argument("--name", default=default(None),
                        help="result file name (default from the flags)")
    parser.add_argument("--out", default=default(None))
    return parser


def parse_rehearsals(argv=None) -> tuple:
    """(the process's options, one namespace per rehearsal, checked), or a parser error. The
    flags before the first --then are a rehearsal (if they say what to run) and every later
    one's defaults; each --then's flags change those (giving --seq-lens, --longest or
    --compare-window replaces all three; a switch is turned off by its --no- form)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chunks = [[]]
    for arg in argv:
        chunks.append([]) if arg == THEN else chunks[-1].append(arg)
    parser = make_parser()
    main = parser.parse_args(chunks[0])
    rehearsals = []
    givens = [vars(make_parser(suppress=True).parse_args(flags)) for flags in chunks[1:]]
    for given in givens:  # the process's flags, wherever they are
        vars(main).update({k: given.pop(k) for k in PROCESS_FLAGS if k in given})
    for flags, given in zip(chunks[1:], givens):
        run = copy.copy(main)
        if any(what in given for what in WHAT_TO_RUN):
            run.seq_lens, run.longest, run.compare_window = [], False, None
        vars(run).update(given)
        run.flags = shlex.join(flags)
        rehearsals.append(run)
    if any(getattr(main, what) for what in WHAT_TO_RUN):
        rehearsals.insert(0, copy.copy(main))
        rehearsals[0].flags = ""
    if not rehearsals:
        parser.error("nothing to rehearse: give --seq-lens, --longest or --compare-window "
                     "(before the first --then or after one)")
    for run in rehearsals:
        try:
            check_rehearsal(run)
        except ValueError as error:
            parser.error(f"{run.flags or 'the flags'}: {error}")
    return main, rehearsals


def check_rehearsal(opts) -> None:
    """Fill the defaults that follow from the flags and refuse what cannot run, before any work."""
    if opts.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {opts.gpus}")
    if not 0 <= opts.rank < opts.gpus:
        raise ValueError(f"--rank must be one of the {opts.gpus} ranks (0..{opts.gpus - 1}), "
                         f"got {opts.rank}")
    if opts.model not in PRESETS:
        raise ValueError(f"unknown --model {opts.model!r}: one of {', '.join(PRESETS)}")
    if not 1 <= opts.stack <= 5:
        raise ValueError(f"--stack must be 1..5 for N ranks (FSDP at least), got {opts.stack}")
    if not opts.host_ballast and not opts.offload_model_state:
        raise ValueError("--no-host-ballast is a setting of --offload-model-state (the ballast "
                         "is on the GPU otherwise)")
    if not 1 <= opts.layers <= get_model_args(opts.model).n_layers:
        raise ValueError(f"--layers must be 1..{get_model_args(opts.model).n_layers}")
    on_gpu_fa4 = opts.device == "cuda" and kernels.fa4_installed()
    if opts.window is None:
        opts.window = 256 if on_gpu_fa4 and opts.attn_kernel in ("auto", "fa4") else 0
    if opts.window < 0:
        raise ValueError(f"--window must be >= 0 (0: the full kernel), got {opts.window}")
    if opts.window and opts.attn_kernel not in ("auto", "fa4"):
        raise ValueError(f"--window {opts.window} cuts FlashAttention-4's work; --attn-kernel "
                         f"{opts.attn_kernel} runs another kernel (--window 0: the full one)")
    if opts.window and not on_gpu_fa4:
        raise ValueError(f"--window {opts.window} cuts FlashAttention-4's work: it needs FA4 on "
                         f"a GPU (here: {opts.device}, FA4 "
                         f"{'installed' if kernels.fa4_installed() else 'not installed'}); "
                         f"--window 0 runs the full kernel")
    if opts.compare_window and not opts.window:
        raise ValueError("--compare-window compares the full kernel with --window W > 0")
    opts.gpu_mem_bytes = planner.parse_bytes(opts.gpu_mem)
    opts.outside_bytes = (planner.parse_bytes(opts.outside_allocator)
                          if opts.outside_allocator not in ("0", 0) else 0)
    opts.host_mem_bytes = planner.parse_bytes(opts.host_mem)
    if opts.outside_bytes >= opts.gpu_mem_bytes:
        raise ValueError("--outside-allocator must be less than --gpu-mem")
    opts.seq_lens = [parse_tokens(n) for n in opts.seq_lens]
    opts.compare_window = parse_tokens(opts.compare_window) if opts.compare_window else None
    opts.first_length = parse_tokens(opts.first_length) if opts.first_length else None
    sp = opts.gpus  # the granularity keeps whole K-token shards on every rank
    opts.granularity = -(-parse_tokens(opts.granularity) // (sp * 1024)) * sp * 1024
    for length in opts.seq_lens + [opts.compare_window or opts.granularity]:
        full_config(opts, length)  # bad flags: train.py's own error
        check_layout(full_config(opts, length), opts.gpus, get_model_args(opts.model))


def result_name(main, rehearsals) -> str:
    first = rehearsals[0]
    return main.name or (f"rehearse_{first.model}_{first.gpus}gpu_stack{first.stack}"
                         + (f"_ring{first.ring}" if first.ring else "")
                         + ("_offload_model_state" if first.offload_model_state else "")
                         + ("_cpu" if main.device == "cpu" else ""))


def main(argv=None):
    main_opts, rehearsals = parse_rehearsals(argv)
    started = time.perf_counter()
    result = {"what": "rank r of an N-GPU training step, rehearsed in one process (fake "
                      "process group; module docstring)",
              "method": __doc__.split("Method. ")[1].split("\n\n")[0].replace("\n", " "),
              "real": REAL, "not_real": NOT_REAL, "budget_s": main_opts.budget_s, "runs": []}
    name = result_name(main_opts, rehearsals)
    claim_result(name, main_opts.out)  # never over an earlier run's result

    def save():
        result["wall_s"] = time.perf_counter() - started
        write_result(name, result, main_opts.out, announce=False)

    for opts in rehearsals:
        try:
            rehearse(opts, result, save, started)
        except Exception as error:  # noqa: BLE001 - a later rehearsal may still run
            if dist.is_initialized():
                dist.destroy_process_group()
            result["runs"][-1]["error"] = f"{type(error).__name__}: {error}"
            print(f"rehearsal {opts.flags or '(main flags)'} failed: {result['runs'][-1]['error']}",
                  flush=True)
            del error
            gc.collect()
            save()
        release(torch.device(main_opts.device))
    synchronize(torch.device(main_opts.device))
    print(f"wrote {write_result(name, result, main_opts.out, announce=False)}")


if __name__ == "__main__":
    main()
