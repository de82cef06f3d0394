"""05 - Untied Ulysses (UPipe): Ulysses attention one chunk of heads at a time.

The problem in bytes. After 01-04, Llama-3-8B at 3M tokens on 8 GPUs fits, but attention is now
the biggest thing on the GPU. Ulysses (02) holds Q and the output of all of a rank's heads at
once, twice: in the token layout (393,216 local tokens x 32 heads x 128 x 2 bytes = 3.0 GiB each)
and in the head layout (3M tokens x 4 heads x 128 x 2 bytes = 3.0 GiB each), plus K and V
(0.75 GiB per layout each); backward keeps Q, K, V and the output of every head. The paper's
chart: 33.0 GiB of attention activations per GPU.

The idea (Ghadia et al., "Untied Ulysses", arXiv 2602.21196): heads are independent, so run them
in H/U stages of U query heads over all P ranks (the head chunk, --head-chunk), U/P per rank. A
stage projects and rotates only its heads, exchanges them (all-to-all), runs attention and
exchanges the result back into its slice of ONE output buffer; the next stage reuses the memory.
With grouped-query attention consecutive stages share KV heads (a KV group): K/V are projected
and exchanged once per group. Backward keeps the input, the output and each stage's log-sum-exp;
per stage it recomputes the projections (rotary's gradient is the inverse rotation), exchanges
the output and its gradient, and runs the kernel's backward: no attention forward (03's
recompute reruns it, unless --keep-attention: base/checkpointed.py's seam). At U = P a stage
holds 0.75 GiB per tensor instead of 3.0: 19.5 GiB instead of 33.0, enough for 5M tokens. Heads
keep the standard order, so the numbers are those of 02 and of unsharded attention.

In training, `python train.py --untied [--head-chunk U]` takes 02's place, one seam further out:
attn.attend, the projections and the kernel, where 02 replaces attn.core, the kernel alone. A
larger U runs fewer, bigger stages (faster), U = P needs the least memory. Without --head-chunk a
GPU run takes the planner's choice: the fewest stages whose planned step fits (plan.py's
`plan_run`).

    torchrun --nproc-per-node 2 05_untied_ulysses.py                    # CPU/gloo: tiny model
    torchrun --nproc-per-node 2 05_untied_ulysses.py --model llama3-8b --seq-len 256K   # GPUs
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from base import checkpointed, fused, kernels
from model import rms_norm

ulysses = importlib.import_module("02_ulysses")


@dataclass(frozen=True)
class StageLayout:
    """What the staged sub-layer needs besides tensors: the ranks and how heads are staged."""
    group: object     # the sequence-parallel process group
    sp: int           # its size P
    head_chunk: int   # U: the query heads of one stage, over all ranks
    head_dim: int
    eps: float        # QK-norm's epsilon (unused without QK-norm)
    cu_seqlens: tuple | None  # packed documents' global boundaries: a stage holds all tokens
                              # of its heads (with 06's ring, its share, which the ring's
                              # block pairs place), so they apply unchanged
    # A stage's attention: (forward -> (out, lse), backward from them), the kernel's over all
    # tokens, or 06's ring over this rank's share of them (Ulysses x ring).
    attention: tuple[Callable, Callable]

    def to_heads(self, t):  # (B, S/P, U, D) -> (B, S, U/P, D): all tokens, this rank's heads
        return self.exchange(t, ulysses.TO_HEADS)

    def to_tokens(self, t):  # the inverse
        return self.exchange(t, ulysses.TO_TOKENS)

    def exchange(self, t, patterns):  # 02's all_to_all; nothing with one rank (sp == 1)
        return t if self.sp == 1 else ulysses.all_to_all(t.contiguous(), self.group, patterns)

    def rows(self, weight, n_heads, heads: slice):
        return stage_rows(weight, n_heads, self.sp, self.head_dim, heads)

    def projected_to_heads(self, x, rows, norm_weight=None, rope=None):
        """Q or K (V: no norm or rope) of `rows`' heads in the head layout (B, S, U/P, D)."""
        return self.to_heads(projected_heads(x, rows, self.head_dim, norm_weight, self.eps, rope))

    def head_blocks(self, t):  # (B, S/P, H * D) -> (B, S/P, P, H/P, D): rank r's heads in block r
        return t.unflatten(-1, (self.sp, -1, self.head_dim))


class UntiedUlyssesAttention(torch.autograd.Function):
    """normed x (B, S/P, dim) of the local tokens -> attention output (B, S/P, H * D), standard
    head order, before o_proj. Weights are inputs (read at call time) and get gradients."""

    @staticmethod
    def forward(ctx, layout: StageLayout, x, cos, sin, wq, wk, wv, q_norm, k_norm):
        out, *lses = checkpointed.forward_or_kept(  # --keep-attention: not rerun in recompute
            UntiedUlyssesAttention.stages, layout, x, cos, sin, wq, wk, wv, q_norm, k_norm)
        ctx.save_for_backward(x, cos, sin, wq, wk, wv, q_norm, k_norm, out, *lses)
        ctx.layout = layout
        return out

    @staticmethod
    def stages(layout: StageLayout, x, cos, sin, wq, wk, wv, q_norm, k_norm):
        """The forward's work: (output, *every stage's log-sum-exp)."""
        head_dim, rope, sp = layout.head_dim, (cos, sin), layout.sp
        n_heads, n_kv_heads = wq.shape[0] // head_dim, wk.shape[0] // head_dim
        out = x.new_empty(*x.shape[:2], n_heads * head_dim)  # the one output buffer
        out_blocks = layout.head_blocks(out)
        attention_forward, _ = layout.attention
        lses = []
        for kv_heads, stages in kv_groups(stage_plan(n_heads, n_kv_heads, sp, layout.head_chunk)):
            k = v = None  # free the previous group's K/V before making the next
            k = layout.projected_to_heads(x, layout.rows(wk, n_kv_heads, kv_heads), k_norm, rope)
            v = layout.projected_to_heads(x, layout.rows(wv, n_kv_heads, kv_heads))
            for heads in stages:
                q = layout.projected_to_heads(x, layout.rows(wq, n_heads, heads), q_norm, rope)
                stage_out, lse = attention_forward(q, k, v, cu_seqlens=layout.cu_seqlens)
                del q
                lses.append(lse)
                # back to this rank's tokens, into this stage's heads of every rank's block
                out_blocks[:, :, :, heads] = layout.to_tokens(stage_out).unflatten(2, (sp, -1))
                del stage_out
        return (out, *lses)

    @staticmethod
    def backward(ctx, grad_out):
        x, cos, sin, wq, wk, wv, q_norm, k_norm, out, *lses = ctx.saved_tensors
        layout, rope = ctx.layout, (cos, sin)
        head_dim, eps, sp = layout.head_dim, layout.eps, layout.sp
        n_heads, n_kv_heads = wq.shape[0] // head_dim, wk.shape[0] // head_dim
        out_blocks, grad_blocks = layout.head_blocks(out), layout.head_blocks(grad_out)
        # Gradient buffers allocated once; every stage adds its share in place.
        grad_x = torch.zeros_like(x)
        grad_wq, grad_wk, grad_wv = (torch.zeros_like(w) for w in (wq, wk, wv))
        grad_q_norm = None if q_norm is None else torch.zeros_like(q_norm)
        grad_k_norm = None if k_norm is None else torch.zeros_like(k_norm)
        lses = iter(lses)

        for kv_heads, stages in kv_groups(stage_plan(n_heads, n_kv_heads, sp, layout.head_chunk)):
            # The KV group's K and V, recomputed once for all its stages.
            wk_rows = layout.rows(wk, n_kv_heads, kv_heads)
            wv_rows = layout.rows(wv, n_kv_heads, kv_heads)
            k = layout.projected_to_heads(x, wk_rows, k_norm, rope)
            v = layout.projected_to_heads(x, wv_rows)
            grad_k = grad_v = None
            for i, heads in enumerate(stages):
                wq_rows = layout.rows(wq, n_heads, heads)
                grad_q, grad_k_stage, grad_v_stage = stage_attention_backward(
                    layout, x, wq_rows, q_norm, rope, k, v, out_blocks[:, :, :, heads],
                    grad_blocks[:, :, :, heads], next(lses))
                if i == len(stages) - 1:
                    del k, v  # the group's last stage: K/V go before the projections' backward
                grad_k = grad_k_stage if grad_k is None else grad_k.add_(grad_k_stage)
                grad_v = grad_v_stage if grad_v is None else grad_v.add_(grad_v_stage)
                del grad_k_stage, grad_v_stage
                grad_rows = projection_backward(x, wq_rows, head_dim, q_norm, eps, rope,
                                                layout.to_tokens(grad_q), grad_x, grad_q_norm)
                del grad_q
                add_stage_rows(grad_wq, grad_rows, n_heads, sp, head_dim, heads)
            # The group's K/V gradients are complete: back through their projections.
            grad_rows = projection_backward(x, wk_rows, head_dim, k_norm, eps, rope,
                                            layout.to_tokens(grad_k), grad_x, grad_k_norm)
            add_stage_rows(grad_wk, grad_rows, n_kv_heads, sp, head_dim, kv_heads)
            grad_rows = projection_backward(x, wv_rows, head_dim, None, eps, None,
                                            layout.to_tokens(grad_v), grad_x, None)
            add_stage_rows(grad_wv, grad_rows, n_kv_heads, sp, head_dim, kv_heads)
            del grad_k, grad_v

        return None, grad_x, None, None, grad_wq, grad_wk, grad_wv, grad_q_norm, grad_k_norm


def stage_attention_backward(layout, x, wq_rows, q_norm, rope, k, v, stage_out, grad_stage_out,
                             lse):
    """One stage's attention backward, (dq, dk, dv) in the head layout: the stage's q
    recomputed, its output and output gradient (this rank's tokens, the stage's heads of every
    rank's block) exchanged to the head layout, and the kernel's backward with the saved
    log-sum-exp: no attention forward here."""
    q = layout.projected_to_heads(x, wq_rows, q_norm, rope)
    stage_out = layout.to_heads(stage_out.flatten(2, 3))
    grad_stage_out = layout.to_heads(grad_stage_out.flatten(2, 3))
    _, attention_backward = layout.attention
    return attention_backward(grad_stage_out, q, k, v, stage_out, lse, cu_seqlens=layout.cu_seqlens)


# The projections of one stage's heads, and their backward.

def projected_heads(x, rows, head_dim, norm_weight, eps, rope):
    """Q or K of the heads in `rows`: projected, per-head normed (Qwen3's QK-norm, when present),
    rotated (model.apply_rope, one kernel on CUDA: base/fused.py), in model.project_qkv's order.
    V: rope=None, projected only."""
    y = project(x, rows, head_dim)
    if rope is None:
        return y
    if norm_weight is not None:
        y = rms_norm(y, norm_weight, eps)
    return fused.rotate(y, *rope)


def project(x, rows, head_dim):
    """x (B, s, dim) @ rows.T -> (B, s, heads, D)."""
    return F.linear(x, rows).unflatten(-1, (-1, head_dim))


def projection_backward(x, rows, head_dim, norm_weight, eps, rope, grad_heads, grad_x,
                        grad_norm_weight):
    """Backward of `projected_heads`: adds into grad_x (and grad_norm_weight) in place, returns
    the gradient of `rows`. Rotary's gradient is the inverse rotation (sin negated): no
    recompute. QK-norm recomputes its input, the projection, under autograd. The projection's
    backward is written out so grad_x accumulates in place (autograd would return a full-size
    temporary per stage)."""
    if rope is not None:
        cos, sin = rope
        grad_heads = fused.rotate_back(grad_heads, cos, sin)
        if norm_weight is not None:
            y = project(x, rows, head_dim).requires_grad_()
            weight = norm_weight.detach().requires_grad_()
            with torch.enable_grad():
                normed = rms_norm(y, weight, eps)
            grad_heads, grad_weight = torch.autograd.grad(normed, [y, weight], grad_heads)
            grad_norm_weight += grad_weight
    dim = x.shape[-1]
    grad_y = grad_heads.reshape(-1, rows.shape[0])
    grad_x.view(-1, dim).addmm_(grad_y, rows)
    return grad_y.t() @ x.reshape(-1, dim)


# Index helpers: how heads are staged, which rows of the projection weights one stage uses.

def stage_plan(n_heads: int, n_kv_heads: int, sp: int, head_chunk: int):
    """(query-head slice, KV-head slice) of each of the H/U stages, within each rank's block.

    Stage t gives rank r its query heads r*H/P + t*U/P + [0, U/P) (Ulysses order). They use KV
    heads (r*H/P + t*U/P + i) // G, G = H/Hkv query heads per KV head; stages that use the same
    ones form a KV group and get the same KV slice, so K/V are exchanged once for all of them.
    """
    heads_per_rank_per_stage = head_chunk // sp
    group_size = n_heads // n_kv_heads  # G
    kv_heads_per_rank_per_stage = (max(1, heads_per_rank_per_stage // group_size)
                                   if n_kv_heads >= sp else 1)
    plan = []
    for stage in range(n_heads // head_chunk):
        first = stage * heads_per_rank_per_stage
        # Rank blocks start at a KV-group boundary, so the offset within the block decides.
        # With KV heads < P all of a rank's query heads use its one (replicated) KV head.
        kv_first = first // group_size if n_kv_heads >= sp else 0
        plan.append((slice(first, first + heads_per_rank_per_stage),
                     slice(kv_first, kv_first + kv_heads_per_rank_per_stage)))
    return plan


def kv_groups(plan) -> list:
    """[(KV-head slice, [query-head slice of each stage])]: consecutive stages that use the same
    K/V heads, so K/V are projected and exchanged once for all of them."""
    groups = []
    for heads, kv_heads in plan:
        if groups and groups[-1][0] == kv_heads:
            groups[-1][1].append(heads)
        else:
            groups.append((kv_heads, [heads]))
    return groups


def rank_blocks(weight: torch.Tensor, n_heads: int, sp: int, head_dim: int) -> torch.Tensor:
    """Projection rows (n_heads * D, dim) as (P, heads per rank, D, dim): block r holds the
    heads rank r attends with. With fewer heads than ranks (KV heads < P) each head's weight rows
    are repeated for the ranks that share it: the same K/V as 02's `replicate_kv_heads`, which
    repeats the projected heads instead (here the projection runs P/Hkv times for those rows)."""
    rows = weight.view(n_heads, head_dim, -1)
    if n_heads >= sp:
        return rows.view(sp, n_heads // sp, head_dim, -1)
    copies = sp // n_heads
    return rows[:, None].expand(n_heads, copies, head_dim, -1).reshape(sp, 1, head_dim, -1)


def stage_rows(weight, n_heads, sp, head_dim, heads: slice) -> torch.Tensor:
    """The rows of `heads` (a slice within every rank's block), rank 0's first: projecting x
    with them gives (B, S/P, P * heads, D) ready for the all-to-all that sends block j to rank j."""
    blocks = rank_blocks(weight, n_heads, sp, head_dim)[:, heads]
    return blocks.reshape(-1, blocks.shape[-1])


def add_stage_rows(grad_weight, grad_rows, n_heads, sp, head_dim, heads: slice) -> None:
    """Accumulate the gradient of `stage_rows(...)` into the full weight gradient buffer."""
    dim = grad_weight.shape[-1]
    if n_heads >= sp:
        grad_weight.view(sp, n_heads // sp, head_dim, dim)[:, heads] += grad_rows.view(
            sp, -1, head_dim, dim)
    else:  # a KV head repeated for sp // n_heads ranks: its gradient is the sum of the copies
        grad_weight.view(n_heads, head_dim, dim).add_(
            grad_rows.view(n_heads, sp // n_heads, head_dim, dim).sum(1))


def untied_attend(x, rope, attn, group, head_chunk, cu_seqlens=None, attention=()):
    """The model's seam 2 (Attention.attend) for `attn`, its weights read at call time.
    cu_seqlens: packed documents' global boundaries, applied unchanged in every stage.
    attention: a stage's (forward, backward) instead of the kernel's (06's ring)."""
    cos, sin = rope
    sp = ranks_of(group)
    q_norm = None if attn.q_norm is None else attn.q_norm.weight
    k_norm = None if attn.k_norm is None else attn.k_norm.weight
    eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
    attention = attention or (kernels.attention_forward_lse, kernels.attention_backward_lse)
    layout = StageLayout(group, sp, head_chunk, attn.head_dim, eps, cu_seqlens, attention)
    return UntiedUlyssesAttention.apply(layout, x, cos, sin, attn.q_proj.weight,
                                        attn.k_proj.weight, attn.v_proj.weight, q_norm, k_norm)


def apply_untied_ulysses(model, group, head_chunk: int | None = None, attention=()) -> None:
    """Make every attention layer of `model` Untied-Ulysses sequence-parallel over `group` with
    head chunk U = `head_chunk` (default: P, the least memory). Only the `attend` seam is
    replaced, so this works on a meta-device model before FSDP shards it. attention: each
    stage's (forward, backward) with log-sum-exp, if not the kernel's (06 passes its ring's)."""
    args = model.args
    sp = ranks_of(group)
    head_chunk = check_head_chunk(args.n_heads, args.n_kv_heads, sp, head_chunk)
    for block in model.layers:
        attn = block.self_attn
        attn.attend = partial(untied_attend, attn=attn, group=group, head_chunk=head_chunk,
                              attention=tuple(attention))


def ranks_of(group) -> int:
    """P, the ranks of `group` (1 in a process without torch.distributed: the demo, tests)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


# ---- below: checks, demo -------------------------------------------------------------------------

def check_head_chunk(n_heads: int, n_kv_heads: int, sp: int, head_chunk: int | None) -> int:
    """The head chunk U (default P, the least memory), or ValueError naming the numbers: every
    rank needs the same number of heads per stage (U % P == 0), the stages must cover the heads
    exactly (H % U == 0), and a rank's heads in one stage must use whole KV heads."""
    ulysses.check_ulysses_shapes(n_heads, n_kv_heads, sp)
    head_chunk = sp if head_chunk is None else head_chunk
    if head_chunk < 1 or head_chunk % sp:
        raise ValueError(f"Untied Ulysses needs the head chunk U ({head_chunk}) to be a positive "
                         f"multiple of the sequence-parallel degree ({sp}): every stage gives "
                         f"each rank U/{sp} query heads (try U = {sp})")
    if n_heads % head_chunk:
        raise ValueError(f"Untied Ulysses needs the head chunk U ({head_chunk}) to divide the "
                         f"query heads ({n_heads}) so the stages cover every head once")
    group_size = n_heads // n_kv_heads  # query heads per KV head (G)
    heads_per_rank_per_stage = head_chunk // sp
    if (n_kv_heads >= sp and group_size % heads_per_rank_per_stage
            and heads_per_rank_per_stage % group_size):
        raise ValueError(f"Untied Ulysses needs the query heads per rank per stage (U/P = "
                         f"{head_chunk}/{sp} = {heads_per_rank_per_stage}) to divide, or be a "
                         f"multiple of, the query heads per KV head ({n_heads}/{n_kv_heads} = "
                         f"{group_size}), so each KV head's query heads fall into whole stages")
    return head_chunk


def valid_head_chunks(args, sp: int) -> list[int]:
    """Every head chunk U that `check_head_chunk` accepts, smallest first."""
    head_chunks = []
    for head_chunk in range(sp, args.n_heads + 1, sp):
        try:
            head_chunks.append(check_head_chunk(args.n_heads, args.n_kv_heads, sp, head_chunk))
        except ValueError:
            pass
    return head_chunks


# Demo: attention memory per rank for every head chunk U, next to Ulysses.

def main():
    from support import byte_counts
    from support.demos import (attention_demo_setup, attention_input, end_ranks,
                               measure_stage_memory, measured_what, print_measured_and_planned)

    demo = attention_demo_setup("05_untied_ulysses.py")
    args, attn, sp, seq_len, group = demo.args, demo.attn, demo.sp, demo.seq_len, dist.group.WORLD
    ulysses.check_ulysses_shapes(args.n_heads, args.n_kv_heads, sp, seq_len)
    x, rope = attention_input(demo, seq_len // sp)
    value_bytes = torch.finfo(demo.dtype).bits // 8
    attn.core = partial(ulysses.ulysses_attention, group=group)
    rows = [("Ulysses (02)", "-", "-", measure_stage_memory(attn.attend, x, (rope,)),
             byte_counts.attention_activation_bytes(args, seq_len, sp, value_bytes))]
    for head_chunk in valid_head_chunks(args, sp):
        attn.attend = partial(untied_attend, attn=attn, group=group, head_chunk=head_chunk)
        planned = byte_counts.untied_attention_bytes(args, seq_len, sp, head_chunk, value_bytes)
        rows.append(("Untied Ulysses", head_chunk, args.n_heads // head_chunk,
                     measure_stage_memory(attn.attend, x, (rope,)), planned))
    if demo.rank == 0:
        kernel = kernels.lse_kernel(x.new_empty(1, 1, 1, args.head_dim))[0]
        print(f"{demo.model}, {seq_len:,} tokens, {sp} ranks, {demo.dtype}, attention kernel "
              f"{kernel}; one attention layer; measured: {measured_what(demo.on_gpu)}; planned: "
              f"the GPU peak (support/byte_counts.py)")
        print_measured_and_planned(["method", "U", "stages"], rows)
        print(f"  U = all {args.n_heads} heads is one stage, which holds more than Ulysses: "
              f"05 saves memory with several stages (U below the heads, at least the ranks).")
        if not demo.on_gpu:  # the CPU stand-in and the plan count different things
            print("  On a CPU, measured is what Untied Ulysses keeps for backward (output and "
                  "log-sum-exps,\n  the same for every U); U shrinks the peak inside backward "
                  "(planned), which needs a GPU.")
    end_ranks()


if __name__ == "__main__":
    main()
