"""demos.py - what the numbered files' demos (and their tests and benchmarks) share: starting
and ending their processes, one attention layer to measure, and the measurements themselves
(allocator peak on a GPU; on a CPU the bytes autograd keeps; the largest tensor any op makes).
Plumbing only; each lesson is in its numbered file.
"""

import argparse
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from base import kernels
from model import Attention, get_model_args, rope_cos_sin
from support.data import parse_tokens


def start_ranks() -> SimpleNamespace:
    """Join torchrun's process group when launched by it (NCCL on GPUs, gloo on CPUs), else
    stay one process. Returns rank, world, device, dtype (bf16 on GPUs), launched."""
    on_gpu = torch.cuda.is_available()
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("nccl" if on_gpu else "gloo")
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu
              else torch.device("cpu"))
    if on_gpu:
        torch.cuda.set_device(device)
    return SimpleNamespace(rank=dist.get_rank() if launched else 0,
                           world=dist.get_world_size() if launched else 1, device=device,
                           dtype=torch.bfloat16 if on_gpu else torch.float32, on_gpu=on_gpu,
                           launched=launched)


def end_ranks() -> None:
    if dist.is_initialized():
        dist.barrier()  # gloo aborts if a rank tears down while its peer is still in a collective
        dist.destroy_process_group()


def attention_demo_setup(script: str) -> SimpleNamespace:
    """What the attention demos (02, 05, 06) share: flags, the process group, one attention
    layer with training's kernel (base/kernels.py)."""
    parser = argparse.ArgumentParser(description=f"{script}: attention-stage memory per rank")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", default="16K")
    opts = parser.parse_args()
    args = get_model_args(opts.model)
    seq_len = parse_tokens(opts.seq_len)
    if "RANK" not in os.environ:
        raise SystemExit(f"launch with torchrun, e.g. torchrun --nproc-per-node 2 {script}")
    ranks = start_ranks()
    torch.manual_seed(0)
    with torch.device(ranks.device):
        attn = Attention(args).to(ranks.dtype)
    attn.core = kernels.causal_attention
    return SimpleNamespace(**vars(ranks), model=opts.model, args=args, seq_len=seq_len,
                           sp=ranks.world, attn=attn)


def measure_stage_memory(attend, x, extra) -> int:
    """Peak bytes above the input while one stage runs forward and backward: on a GPU the
    allocator's peak; on a CPU the bytes of every tensor the stage saves for backward plus its
    output (what stays alive between forward and backward)."""
    if x.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attend(x, *extra).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attend(x, *extra)
    total = sum(saved.values()) + out.untyped_storage().nbytes()
    out.sum().backward()
    return total


# ---------------------------------------------------------------------------------------------
# Measuring: on a GPU the allocator's peak; on a CPU the bytes autograd keeps for backward.
# ---------------------------------------------------------------------------------------------

def gradient_bytes(model) -> int:
    """Bytes of this rank's gradients once backward has run (FSDP2: of its parameter shards)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def bytes_saved_for_backward(run_step, offloader=None) -> int:
    """CPU stand-in for the GPU allocator's peak: run_step() (forward and backward) and return
    the bytes of distinct storages autograd kept from forward to backward, parameters excluded:
    their sizes when backward first reads one (03's kept blocks have released their norms'
    outputs by then, and compute them again later).

    The offloader's hooks sit inside ours (only the innermost saved-tensors hooks run), so the
    one block input it keeps on the device is added from its own count.
    """
    saved, kept = {}, []

    def pack(t):
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):  # parameters (also FSDP's gathered ones)
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t

    def held() -> int:
        return sum(storage.nbytes() for storage in saved.values())

    def unpack(t):
        if not kept:  # backward begins: what forward left
            kept.append(held())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        run_step()
    return (kept[0] if kept else held()) + (offloader.stats["kept_bytes"] if offloader else 0)


# ---------------------------------------------------------------------------------------------
# Measuring: the largest tensor any op produces (shows a buffer never exists).
# ---------------------------------------------------------------------------------------------

class LargestTensor(TorchDispatchMode):
    """While active, record the largest tensor (elements and shape) produced by any operation,
    forward and backward. Views count too: a view of seq x vocab means seq x vocab exists."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape, self.nbytes = 0, None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
                self.nbytes = t.numel() * t.element_size()
        return out


# ---- 05 and 06's demos: one attention per rank, measured beside support/byte_counts.py's plan --

MiB, GiB = 2**20, 2**30


def measured_what(on_gpu: bool) -> str:
    """What `measure_stage_memory` counts on this device, for a demo's title line."""
    return ("allocator peak above the input (GPU)" if on_gpu
            else "saved-for-backward + output bytes (CPU)")


def attention_input(demo, tokens: int, sharded: bool = True):
    """This rank's `tokens` consecutive tokens of a random normed input (1, tokens, dim) that
    wants gradients, and the rotary of their global positions (sharded=False: every rank holds
    the whole sequence, from position 0)."""
    first = demo.rank * tokens if sharded else 0
    positions = torch.arange(first, first + tokens, device=demo.device)[None]
    x = torch.randn(1, tokens, demo.args.dim, device=demo.device, dtype=demo.dtype,
                    requires_grad=True)
    return x, rope_cos_sin(positions, demo.args, demo.dtype)


def print_measured_and_planned(headers, rows) -> None:
    """A table whose rows end in (measured bytes, planned bytes), in MiB, or GiB if large."""
    unit, unit_name = (GiB, "GiB") if max(row[-2] for row in rows) >= GiB else (MiB, "MiB")
    table = [[*headers, f"measured {unit_name}", f"planned {unit_name}"]]
    table += [[str(cell) for cell in row[:-2]] + [f"{n / unit:.2f}" for n in row[-2:]]
              for row in rows]
    indented = [["  " + first, *rest] for first, *rest in table]
    widths = [max(len(line[i]) for line in table) + 2 for i in range(len(table[0]))]
    print_table(indented[0], indented[1:], widths)  # each column 2 wider: the same gaps


# ---------------------------------------------------------------------------------------------
# 03's and 04's demos: flags and ranks, one step's memory under a technique, phases' memory, a
# table of it.
# ---------------------------------------------------------------------------------------------

def demo_parser(doc: str, cpu: tuple[str, str], gpu: tuple[str, str]) -> argparse.ArgumentParser:
    """--model and --seq-len (total tokens), defaulting to the (model, length) of `gpu` or `cpu`
    by where the demo runs; the demo adds its own flags."""
    model, seq_len = gpu if torch.cuda.is_available() else cpu
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--model", default=model, help=f"default: {cpu[0]} on CPU, {gpu[0]} on GPU")
    parser.add_argument("--seq-len", default=seq_len, help=f"total tokens (default: {cpu[1]} on "
                                                           f"CPU, {gpu[1]} on GPU)")
    return parser


def demo_setup(opts) -> SimpleNamespace:
    """The parsed flags (opts), the ranks (start_ranks), the model's args, the tokens in all
    (seq_len) and per rank (local, cut over the ranks as Ulysses cuts them), and a line saying
    so (setting)."""
    from support.lessons import ulysses_sp

    args, seq_len = get_model_args(opts.model), parse_tokens(opts.seq_len)
    ranks = start_ranks()
    try:
        ulysses_sp.check_sequence_split(seq_len, ranks.world)
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    local = seq_len // ranks.world
    setting = (f"{opts.model}, {seq_len:,} tokens over {ranks.world} "
               f"rank{'s' if ranks.world > 1 else ''} ({local:,} each), {ranks.dtype} on "
               f"{ranks.device.type}")
    return SimpleNamespace(**vars(ranks), opts=opts, args=args, seq_len=seq_len, local=local,
                           setting=setting)


def measure_step_memory(demo, args, mesh, techniques) -> dict:
    """Build the model of `args` with `techniques(model)` applied on the meta device (after
    Ulysses over every rank when launched with torchrun; FSDP over `mesh`), run one forward and
    backward of random tokens, and return this rank's {"device": bytes, "host": bytes}. Device:
    on a GPU the peak allocated above the parameters and their gradients (None where it ran
    out), on a CPU the bytes kept for backward; host: 03's and 07's offloaders' buffers."""
    import gc

    from support.build import build_model
    from support.lessons import ulysses_sp

    group = dist.group.WORLD if demo.launched else None

    def before_sharding(model):
        if demo.launched:
            ulysses_sp.apply_ulysses(model, group)
        techniques(model)

    model = build_model(args, demo.device, mesh, demo.dtype, exact_init=not demo.on_gpu,
                        before_sharding=before_sharding)
    offloader = getattr(model, "checkpoint_offload", None)
    tokens = torch.randint(0, args.vocab_size, (1, demo.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(demo.device)

    def step():
        ulysses_sp.loss_and_backward(model, tokens, demo.rank, demo.world, group)

    try:
        if demo.on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            # Above the model state: its gradients grow with the layers, as the parameters do.
            device_bytes = torch.cuda.max_memory_allocated() - before - gradient_bytes(model)
        else:
            device_bytes = bytes_saved_for_backward(step, offloader)
    except torch.OutOfMemoryError:
        device_bytes = None
    host_bytes = sum(held.host_buffers.nbytes for held in
                     (offloader, getattr(model, "activation_offload", None)) if held)
    model = offloader = step = None
    gc.collect()  # a block and its replaced forward refer to each other: free them now
    if demo.on_gpu:
        torch.cuda.empty_cache()
    return {"device": device_bytes, "host": host_bytes}


def step_memory_meaning(on_gpu: bool) -> str:
    """What measure_step_memory's device bytes are, for a demo's table."""
    return ("peak GPU memory allocated in forward+backward above the parameters and their "
            "gradients" if on_gpu else "bytes kept from forward to backward (saved tensors; CPU)")


def measure_phases(phases: dict, new_input, model) -> dict:
    """{name: (bytes, largest tensor's bytes)} for each phase, run(x) forward and backward on
    x = new_input() (measure_stage_memory, LargestTensor); (None, None) where a GPU ran out.
    The model's gradients are dropped after each phase."""
    results = {}
    for name, run in phases.items():
        x = new_input().requires_grad_()
        try:
            with LargestTensor() as largest:
                results[name] = (measure_stage_memory(run, x, ()), largest.nbytes)
        except torch.OutOfMemoryError:
            results[name] = (None, None)
        x = None
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def in_units(nbytes, unit: int, digits: int = 1) -> str:
    """nbytes in `unit` (2**20, 2**30), or "OOM" for None (a GPU ran out)."""
    return "OOM" if nbytes is None else f"{nbytes / unit:.{digits}f}"


def print_table(header: list[str], rows: list[list], widths: list[int]) -> None:
    """A header line and rows in columns of `widths` characters: the first column aligned left,
    the others right."""
    for row in [header, *rows]:
        first, *rest = row
        print(f"{first:<{widths[0]}}"
              + "".join(f"{cell:>{width}}" for cell, width in zip(rest, widths[1:])))
