"""Packed documents: a window of many documents trains exactly as its documents would alone.

The promise, for every technique (--stack 0..5) at P = 1, 2, 4 and dp x sp: the loss and every
parameter gradient of packed windows equal the sum over their documents, each run separately
through the plain single-process model with its own positions and labels. The reference is
computed from the list of documents, not from data.py, so it checks data.py too. The windows
hold every case that breaks peers: documents crossing shard boundaries, a 1-token document, a
document longer than a rank's shard, windows starting inside a document, a window whose last
input ends a document.
"""

import importlib
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from reference import (GPU_HEAD_DIM, GPU_KERNELS, assert_step_matches, assert_within_bf16_error,
                       full, plain_attention_results, with_kernel)

from support import data as data_module
from base import kernels
import model as llama
from support.data import TokenData, documents_in_windows
from support.runtime import Runtime, setup_runtime
from support.config import Config, resolve_techniques

train = importlib.import_module("train")
ulysses = importlib.import_module("02_ulysses")

SEP = 255  # the tiny preset's vocabulary is 256; other tokens are 0..254
SEQ_LEN = 48  # windows of 49 tokens; 12 per rank at P = 4
# Windows [0, 49), [49, 98), [98, 147), [147, 196): window 0 holds a 20-token document (longer
# than a P=4 shard, crossing its boundary), a 1-token document, and its last input ends a
# document; windows 1-3 start inside a document; then long-tailed random lengths.
CRAFTED = [20, 1, 13, 14, 30, 1, 5, 40, 60, 3, 20]


def document_lengths(total: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    lengths = list(CRAFTED)
    while sum(lengths) < total:  # mostly short, some 4x longer
        longer = 4 if torch.rand((), generator=generator) < 0.2 else 1
        lengths.append(longer * int(torch.randint(1, 25, (), generator=generator)))
    return lengths


def make_stream(lengths, seed: int = 0) -> torch.Tensor:
    """The documents concatenated, each ending with SEP (a 1-token document is SEP alone)."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(0, SEP, (n - 1,), generator=generator), torch.tensor([SEP])])
            for n in lengths]
    return torch.cat(docs)


def write_token_file(path, stream, index: bool = False, sidecar: dict | None = None,
                     dtype: str = "uint16") -> str:
    """`stream` (ids) as prepare_data.py writes a token file: flat little-endian `dtype`; with
    index=True the document starts after each SEP (the .idx file), with `sidecar` its JSON. The
    tests' one writer of token files."""
    stream = torch.as_tensor(stream)
    stream.to(torch.int64).numpy().astype(np.dtype(dtype).newbyteorder("<")).tofile(path)
    if index:
        starts = torch.cat([torch.zeros(1, dtype=torch.int64),
                            (stream[:-1] == SEP).nonzero().flatten() + 1])
        starts.numpy().astype("<i8").tofile(data_module.boundary_path(str(path)))
    if sidecar is not None:
        with open(data_module.sidecar_path(str(path)), "w") as f:
            json.dump(sidecar, f)
    return str(path)


def document_bounds(lengths):
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def reference_fragments(stream, lengths, rows: int, seq_len: int = SEQ_LEN):
    """For windows 0..rows-1: every document's fragment inside the window's inputs, as the plain
    model would see that document alone: (input ids, positions within the document, labels:
    the next token while it is in the same document, else ignored)."""
    window = seq_len + 1
    fragments = []
    for row in range(rows):
        w0 = row * window
        for start, end in document_bounds(lengths):
            a, b = max(start, w0), min(end, w0 + seq_len)
            if a >= b:
                continue
            index = torch.arange(a, b)
            labels = torch.where(index + 1 < end, stream[(index + 1).clamp(max=len(stream) - 1)],
                                 llama.IGNORE_INDEX)
            fragments.append((stream[a:b], index - start, labels))
    return fragments


def reference_loss_and_grads(fragments, seed: int = 0, model_name: str = "tiny"):
    model = llama.Transformer(llama.get_model_args(model_name))
    llama.init_weights(model, seed)
    count = sum(int((labels != llama.IGNORE_INDEX).sum()) for _, _, labels in fragments)
    total = 0.0
    for ids, positions, labels in fragments:  # each document alone, gradients summed
        loss = model(ids[None], positions[None], labels[None]) / count
        loss.backward()
        total += loss.detach()
    return torch.as_tensor(total), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# data.py: where the documents are
# ---------------------------------------------------------------------------------------------

def test_documents_of_a_small_window():
    """Two windows by hand: positions restart at each document (continuing one begun before the
    window), the label of each document's last token is ignored, boundaries are global offsets
    over both rows."""
    tokens = torch.tensor([[5, 6, SEP, 7, SEP, 8, 9], [1, 2, 3, SEP, 4, 5, 6]])
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0, [0, 3, 5]] = True  # row 0 starts with a document
    starts[1, [4]] = True  # row 1 starts inside a document, at its position 10
    docs = documents_in_windows(tokens, starts, torch.tensor([0, 10]))
    I = llama.IGNORE_INDEX
    assert docs.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [10, 11, 12, 13, 0, 1]]
    assert docs.labels.tolist() == [[6, SEP, I, SEP, I, 9], [2, 3, SEP, I, 5, 6]]
    assert docs.cu_seqlens == (0, 3, 5, 6, 10, 12)
    assert data_module.IGNORE_INDEX == llama.IGNORE_INDEX


def _token_data(path, rows, **overrides):
    cfg = Config(model="tiny", seq_len=SEQ_LEN, batch_size=rows, data=str(path), **overrides)
    return TokenData(resolve_techniques(cfg), 256, 0, 1)


def test_separator_and_boundary_index_agree(tmp_path):
    """The same stream read through its separators and through a .docs index gives the same
    Documents for every window, and both match the reference fragments."""
    lengths = document_lengths(8 * (SEQ_LEN + 1) + 1)
    stream = make_stream(lengths)
    write_token_file(tmp_path / "sep.bin", stream)
    write_token_file(tmp_path / "idx.bin", stream, index=True, sidecar={"dtype": "uint16"})
    by_sep = _token_data(tmp_path / "sep.bin", 8, doc_sep=SEP)
    by_index = _token_data(tmp_path / "idx.bin", 8, documents=True)  # no separator: index only
    tokens = by_sep.batch(0)
    assert torch.equal(tokens, by_index.batch(0))
    a, b = by_sep.documents(0, tokens), by_index.documents(0, tokens)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.position_ids, b.position_ids)
    assert a.cu_seqlens == b.cu_seqlens
    # Against the reference built from the document list.
    fragments = reference_fragments(stream, lengths, 8)
    assert torch.equal(a.labels.flatten(), torch.cat([f[2] for f in fragments]))
    assert torch.equal(a.position_ids.flatten(), torch.cat([f[1] for f in fragments]))
    assert (list(a.cu_seqlens)
            == torch.tensor([0] + [len(f[0]) for f in fragments]).cumsum(0).tolist())


def test_synthetic_documents_end_with_the_separator():
    cfg = resolve_techniques(Config(model="tiny", seq_len=256, batch_size=2, doc_sep=7))
    data = TokenData(cfg, 256, 0, 1)
    tokens = data.batch(3)
    docs = data.documents(3, tokens)
    assert docs.count > 2
    for row in range(2):
        ends = (tokens[row, :-1] == 7).nonzero().flatten()
        assert (docs.labels[row, ends] == llama.IGNORE_INDEX).all()
        assert (docs.position_ids[row, ends[ends < 255] + 1] == 0).all()
        # each document is a progression over the vocabulary without the separator (its ids
        # above 7 shifted down by one): a constant step of 1-16, the separator never inside
        for doc in tokens[row].tensor_split((tokens[row] == 7).nonzero().flatten() + 1):
            body = doc[:-1] if doc[-1] == 7 else doc
            assert not (body == 7).any()
            steps = (body - (body > 7).long()).diff() % 255
            assert len(set(steps.tolist())) <= 1 and all(1 <= d <= 16 for d in steps), doc


# ---------------------------------------------------------------------------------------------
# Kernels: the per-document loop and its log-sum-exp pair
# ---------------------------------------------------------------------------------------------

def test_document_kernels_equal_attention_per_document():
    check_document_kernels((0, 5, 6, 24, 30, 48))  # row 0: 5, 1, 18 tokens; row 1: 6, 18
    # one document more than the rows: the fewest a dense path must never take as one
    check_document_kernels((0, 5, 24, 48))  # row 0: 5, 19 tokens; row 1: whole


def test_a_one_token_document_never_reaches_a_kernel(monkeypatch):
    """cuDNN refuses key/value length 1 (found on the GPU: --attn-kernel cudnn and a 1-token
    document stopped training). The loops compute such a document without a kernel (02's) or
    with the math kernel (05's), whose lse joins cuDNN's (B, H, S, 1) one. Here the CPU kernel is
    made to behave like cuDNN: it refuses one token and returns its lse with cuDNN's shape."""
    sdpa, forward, backward = F.scaled_dot_product_attention, kernels._forward, kernels._backward

    def refuse_one_token(q, k, v, **options):  # SDPA's layout (B, heads, S, D)
        assert k.shape[2] > 1, "a 1-token document reached SDPA"
        return sdpa(q, k, v, **options)

    def cudnn_like_forward(kernel, q, k, v, causal=True):
        assert q.shape[1] > 1, "a 1-token document reached the kernel"
        out, lse = forward(kernel, q, k, v, causal)
        return out, lse[..., None]

    def cudnn_like_backward(kernel, grad_out, q, k, v, out, lse, causal=True):
        assert q.shape[1] > 1 and lse.dim() == 4, "a 1-token document reached the kernel"
        return backward(kernel, grad_out, q, k, v, out, lse[..., 0], causal)

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse_one_token)
    monkeypatch.setattr(kernels, "_forward", cudnn_like_forward)
    monkeypatch.setattr(kernels, "_backward", cudnn_like_backward)
    check_document_kernels((0, 1, 6, 24, 30, 47, 48))  # 1-token documents at a row's start and end


def check_document_kernels(cu, batch=2, seq_len=24, device="cpu", dtype=torch.float32,
                           head_dim=8):
    """02's loop (autograd) and 05's (forward with lse, explicit backward) against the math
    kernel run on each document alone in fp32 on the CPU (inputs rounded to `dtype` first):
    elementwise in fp32; in bf16 by the one bf16 rule (tests/reference.py), whose unsharded run
    is PyTorch's SDPA in bf16 on each document alone."""
    generator = torch.Generator().manual_seed(0)
    def rounded(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).float()

    q, grad = rounded(batch, seq_len, 4, head_dim), rounded(batch, seq_len, 4, head_dim)
    k, v = rounded(batch, seq_len, 2, head_dim), rounded(batch, seq_len, 2, head_dim)
    on = lambda t: t.to(device, dtype, copy=True)  # noqa: E731
    leaves = [on(t).requires_grad_() for t in (q, k, v)]
    out = kernels.causal_attention(*leaves, cu_seqlens=cu)
    out.backward(on(grad))
    out_lse, lse = kernels.attention_forward_lse(on(q), on(k), on(v), cu_seqlens=cu)
    explicit = kernels.attention_backward_lse(on(grad), on(q), on(k), on(v), out_lse, lse,
                                              cu_seqlens=cu)
    got = {"out": out.detach(), "out (forward_lse)": out_lse,
           **{f"d{n}": t.grad for n, t in zip("qkv", leaves)},
           **{f"d{n} (backward_lse)": t for n, t in zip("qkv", explicit)}}
    spans = kernels.document_spans(cu, batch, seq_len)
    reference, unsharded = ({name: [] for name in got} for _ in range(2))
    for row, start, end in spans:
        part = (slice(row, row + 1), slice(start, end))
        for results, inputs in ((reference, (q, k, v, grad)),
                                (unsharded, tuple(on(t) for t in (q, k, v, grad)))):
            if results is unsharded and dtype == torch.float32:
                continue
            if results is reference:
                ref = [t[part].clone().requires_grad_() for t in inputs[:3]]
                ref_out, ref_lse = kernels.math_attention_forward(*ref)
                ref_out.backward(inputs[3][part])
                values = (ref_out.detach(), *(t.grad for t in ref))
            else:
                values = plain_attention_results(*(t[part] for t in inputs))
            for name, parts in results.items():
                which = name.split(" ")[0]
                parts.append(values[0] if which == "out" else values[1 + "qkv".index(which[1])])
            if dtype == torch.float32:  # the CPU kernel's lse is the math kernel's quantity
                torch.testing.assert_close(lse[row:row + 1, :, start:end].reshape(ref_lse.shape),
                                           ref_lse, rtol=1e-5, atol=1e-6)
    got = {name: torch.cat([t[row:row + 1, start:end] for row, start, end in spans], dim=1)
           for name, t in got.items()}
    reference, unsharded = ({name: torch.cat(parts, dim=1) for name, parts in results.items()
                             if parts} for results in (reference, unsharded))
    if dtype == torch.float32:
        for name, want in reference.items():
            torch.testing.assert_close(got[name].cpu(), want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
    else:
        assert_within_bf16_error(got, unsharded, reference, f"documents {cu}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_document_loops_over_each_gpu_kernel(kernel):
    """02's and 05's per-document loops over each GPU kernel (FA4's varlen off), bf16 against
    the fp32 math kernel per document: 1-token documents at a row's start and end (cuDNN refuses
    key/value length 1; it stopped a packed run under --attn-kernel cudnn) and documents longer
    than a kernel's block, at real models' head size."""
    kernels.use_kernel(kernel)
    kernels.use_varlen(False)
    try:
        check_document_kernels((0, 1, 300, 512, 513, 1023, 1024), batch=2, seq_len=512,
                               device="cuda", dtype=torch.bfloat16, head_dim=GPU_HEAD_DIM)
    finally:
        kernels.use_kernel("auto")
        kernels.use_varlen(True)


def test_document_spans_refuse_boundaries_of_another_batch():
    with pytest.raises(ValueError, match="row start"):
        kernels.document_spans((0, 10, 32), 2, 16)  # misses 16: a document across rows
    with pytest.raises(ValueError, match="rise strictly"):
        kernels.document_spans((0, 16, 16, 32), 2, 16)


# ---------------------------------------------------------------------------------------------
# Packed training == every document on its own, through every technique
# ---------------------------------------------------------------------------------------------

def _packed_equals_documents(cases, path, lengths, batch_size=2, device="cpu", dtype="float32",
                             model_name="tiny"):
    """cases: (--stack, --sp[, --ring[, more Config fields]]): with keep_attention, every block's
    attention output is kept and taken back (its own cu_seqlens path, support/keep_attention.py);
    with grad_accum N, the rows (batch_size, unless the case names its own) go through N
    micro-batches, each its documents' part of the window (data.Documents.rows)."""
    stream = make_stream(lengths)
    world = dist.get_world_size()
    for case in cases:
        stack, sp, ring, more = _case(*case)
        rows = more.get("batch_size", batch_size)
        # attn_kernel: the one this process was given (with_kernel), as setup_runtime sets it again
        tiles = dict(mlp_tile_tokens=8, loss_tile_tokens=8) if stack >= 4 else {}  # (04's)
        cfg = Config(**{**dict(
            model=model_name, stack=stack, sp=sp, ring=ring, seq_len=SEQ_LEN, batch_size=rows,
            data=path, doc_sep=SEP, device=device, dtype=dtype,
            attn_kernel=kernels._requested["kernel"], **tiles), **more})
        cfg = resolve_techniques(cfg)
        rt = setup_runtime(cfg)
        model = train.build_model(cfg, rt)
        data = TokenData(cfg, 256, rt.dp_rank, rt.dp)
        tokens = data.batch(0)
        loss = train.forward_backward(model, tokens, rt, documents=data.documents(0, tokens),
                                      micro_batches=cfg.grad_accum)
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        ref_loss, ref_grads = reference_loss_and_grads(
            reference_fragments(stream, lengths, rt.dp * rows), model_name=model_name)
        what = (f"stack {stack}, world {world}, dp {rt.dp} x sp {rt.sp} (ring {rt.ring})"
                + "".join(f", {k} {v}" for k, v in more.items()))
        # 05 sums its attention in another order (see test_05): compare whole-tensor errors.
        grads = {n: g.float().cpu() for n, g in grads.items()}
        whole = TokenData(replace(cfg, batch_size=rt.dp * rows), 256, 0, 1)  # bf16's rule
        every_row = whole.batch(0)
        assert_step_matches(loss.float().cpu(), grads, ref_loss, ref_grads, model_name, every_row,
                            None, dtype, what=what, documents=whole.documents(0, every_row),
                            norm_rtol=2e-6 if cfg.untied or rt.ring > 1 else None)
        if cfg.keep_attention:  # the kept path ran: each block kept once and took it back
            stats = model.kept_attention.stats  # (of the last micro-batch: a step restarts it)
            assert stats["kept"] == stats["taken"] == len(model.layers), (what, stats)
        if rt.rank == 0:
            print(f"{what}: packed == documents alone (loss {float(loss):.6f})")


def _case(stack, sp, ring=None, more=None):
    return stack, sp, ring, more or {}


KEEP = {"keep_attention": True}
# (--stack, --sp, --ring, more): 06's ring, Ulysses 2 x 2, 1 x 4; --keep-attention through 02's
# kernel, 05's stages and the ring; --grad-accum 2 and 3 (micro-batches of one row each)
STACKS = {1: [(stack, None) for stack in range(0, 6)]
             + [(3, None, None, KEEP), (5, None, None, {**KEEP, "grad_accum": 2})],
          2: [(1, None)] + [(stack, 2) for stack in range(2, 6)] + [(5, 2, 2)]
             + [(3, 2, None, KEEP), (5, 2, None, {**KEEP, "grad_accum": 2}),
                (5, 2, 2, {**KEEP, "grad_accum": 3, "batch_size": 3})],
          4: [(1, None)] + [(stack, 4) for stack in range(2, 6)] + [(2, 2), (5, 2)]
             + [(2, 4, 2), (5, 4, 4)]
             + [(5, 2, None, {"grad_accum": 3, "batch_size": 3}),
                (3, 4, 2, {**KEEP, "grad_accum": 2})]}


@pytest.mark.parametrize("world_size", [world if world == 2 else pytest.param(
    world, marks=pytest.mark.slow) for world in sorted(STACKS)])
def test_packed_training_equals_each_document_alone(world_size, tmp_path):
    """--stack 0..5 at P = world; at 4 ranks also dp 2 x sp 2 (Ulysses and Untied) and FSDP
    alone (dp 4); Ulysses x ring (06: 1 x 2, 2 x 2, Untied 1 x 4), whose block pairs mask by
    document; --keep-attention; --grad-accum 2 and 3, on one and several ranks, with the ring.
    Windows of 2 rows per data-parallel rank (3 where 3 micro-batches), so 2-8 windows."""
    lengths = document_lengths(8 * (SEQ_LEN + 1) + 1)
    path = tmp_path / "packed.bin"
    write_token_file(path, make_stream(lengths))
    run_ranks(world_size, _packed_equals_documents, STACKS[world_size], str(path), lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["loop", "varlen"])
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_packed_training_nccl_bf16_matches_fp32_documents(kernel, varlen, tmp_path):
    """02 and 05 (with the rest of --stack 5), and both as Ulysses 1 x ring 2 (06), on 2 GPUs in
    bf16 against the fp32 reference, with each GPU kernel through the per-document loop, and with
    FA4's varlen launch, --keep-attention through 02's kernel and the ring; the tiny shape
    with real models' head size (tests/reference.py)."""
    if varlen and kernel != "fa4":
        pytest.skip("varlen is FlashAttention-4's")
    lengths = document_lengths(8 * (SEQ_LEN + 1) + 1)
    path = tmp_path / "packed.bin"
    write_token_file(path, make_stream(lengths))
    run_ranks(2, with_kernel, kernel, _with_varlen, varlen, _packed_equals_documents,
              [(2, 2), (4, 2), (5, 2), (2, 2, 2), (5, 2, 2), (4, 2, None, KEEP),
               (5, 2, 2, KEEP)], str(path), lengths, 2, "cuda", "bfloat16", "tiny-hd64",
              backend="nccl")


def _with_varlen(varlen, body, *args):
    kernels.use_varlen(varlen)
    body(*args)
    if varlen:  # the path under test was the one that ran: every shape met passed varlen's check
        checked = {key: ok for key, ok in kernels._VARLEN_CHECKED.items() if key[1] == 64}
        assert checked and all(checked.values()), checked


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.fa4_installed()),
                    reason="needs a GPU with flash-attn-4")
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_fa4_varlen_matches_each_document_alone(head_dim):
    """FA4's varlen launch where its check passes, both as 02 calls it (autograd) and as 05 does
    (forward with the log-sum-exp, then its backward entry point), equals the math kernel on each
    document alone (bf16 inputs, fp32 reference): documents of 1 to 1500 tokens in rows of 2048,
    16 query heads over 4 KV heads (the Ulysses-local Llama-3-8B layout at P = 2)."""
    lengths = (1000, 1, 300, 747, 1500, 37, 511)  # rows of 2048: no document crosses one
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    kernels.use_kernel("fa4")  # set back to auto at the end: later tests in this process
    generator = torch.Generator().manual_seed(1)
    q, grad_out = (torch.randn(2, 2048, 16, head_dim, generator=generator).bfloat16()
                   for _ in range(2))
    k, v = (torch.randn(2, 2048, 4, head_dim, generator=generator).bfloat16() for _ in range(2))
    # The fp32 reference (the math kernel) and the one bf16 rule's unsharded run (SDPA in bf16),
    # each on every document alone.
    want, unsharded = ({name: [] for name in ("out", "dq", "dk", "dv")} for _ in range(2))
    for row, start, end in kernels.document_spans(bounds, 2, 2048):
        part = (slice(row, row + 1), slice(start, end))
        on = [t[part].cuda() for t in (grad_out, q, k, v)]
        out, lse = kernels.math_attention_forward(*(t.float() for t in on[1:]))
        grads = kernels.math_attention_backward(*(t.float() for t in on), out, lse)
        plain = plain_attention_results(*on[1:], on[0])
        for results, values in ((want, (out, *grads)), (unsharded, plain)):
            for name, t in zip(results, values):
                results[name].append(t.flatten(0, 1))
    want, unsharded = ({name: torch.cat(parts) for name, parts in results.items()}
                       for results in (want, unsharded))
    q, k, v, grad_out = (t.cuda() for t in (q, k, v, grad_out))
    # The Llama head sizes must get the one-launch path. At head_dim 8 FA4 4.0.0b36 is wrong
    # (docs/gpu_tests.json): its dense kernel check refuses it, and so does --attn-kernel fa4,
    # clearly; had it passed, the varlen check or the loop would have to give the right result.
    if head_dim < 64:
        try:
            kernels.lse_kernel(q)
        except ValueError as refused:
            assert "fa4 failed its check" in str(refused)
            kernels.use_kernel("auto")
            return
    uses_varlen = kernels.varlen_works(q, k)
    assert uses_varlen or head_dim < 64, "FA4 varlen failed its own check (see the warning)"

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernels.causal_attention(*leaves, cu_seqlens=bounds)  # 02's path: autograd
    out.backward(grad_out)
    autograd = (out, *(t.grad for t in leaves))
    out, lse = kernels.attention_forward_lse(q, k, v, cu_seqlens=bounds)  # 05's path
    explicit = (out, *kernels.attention_backward_lse(grad_out, q, k, v, out, lse,
                                                     cu_seqlens=bounds))
    for path, got in (("autograd", autograd), ("forward_lse/backward_lse", explicit)):
        assert_within_bf16_error({name: t.flatten(0, 1) for name, t in zip(want, got)}, unsharded,
                                 want, f"{path}, head_dim {head_dim}, "
                                       f"{'varlen' if uses_varlen else 'per-document loop'}")
    kernels.use_kernel("auto")


# ---------------------------------------------------------------------------------------------
# The leak test: change one document, nothing else may move by a single bit
# ---------------------------------------------------------------------------------------------

CHANGED = (21, 34)  # the 13-token document of window 0: crosses the shard boundary at P = 2, 4


def _outputs(model, tokens, docs, rt, dense=False):
    """Logits and per-token losses of the whole batch (gathered from the sequence shards)."""
    input_ids, labels, positions = ulysses.shard_sequence(tokens, rt.sp_rank, rt.sp, docs.labels,
                                                          docs.position_ids)
    with torch.no_grad():
        logits = model(input_ids, positions, None, cu_seqlens=None if dense else docs.cu_seqlens)
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                             ignore_index=llama.IGNORE_INDEX).view(labels.shape)
    if rt.sp > 1:
        logits, losses = (torch.cat(_gather(t, rt), dim=1) for t in (logits, losses))
    return logits, losses


def _gather(t, rt):
    parts = [torch.empty_like(t) for _ in range(rt.sp)]
    dist.all_gather(parts, t.contiguous(), group=rt.sp_group)
    return parts


def _one_document_changes_nothing_else(path, changed_path):
    for stack in (0, 2, 5):
        world = dist.get_world_size()
        if stack == 0 and world > 1:
            continue
        cfg = resolve_techniques(Config(model="tiny", stack=stack, seq_len=SEQ_LEN,
                                        batch_size=2, doc_sep=SEP))
        rt = setup_runtime(cfg)
        model = train.build_model(cfg, rt)
        results = []
        for data_path in (path, changed_path):
            cfg.data = data_path
            data = TokenData(cfg, 256, 0, 1)
            tokens = data.batch(0)
            docs = data.documents(0, tokens)
            results.append([*_outputs(model, tokens, docs, rt),
                            *_outputs(model, tokens, docs, rt, True)])
        (logits, losses, dense_logits, _), (logits2, losses2, dense_logits2, _) = results
        inside = torch.zeros(2, SEQ_LEN, dtype=torch.bool)
        inside[0, CHANGED[0]:CHANGED[1]] = True
        what = f"stack {stack}, P = {rt.sp}"
        assert not torch.equal(logits[inside], logits2[inside]), f"{what}: the change did nothing"
        assert torch.equal(logits[~inside], logits2[~inside]), f"{what}: a document leaked"
        assert torch.equal(losses[~inside], losses2[~inside]), f"{what}: a loss leaked"
        # The same check catches the bug it is for: without document masking, later documents
        # attend to the changed one.
        assert not torch.equal(dense_logits[~inside], dense_logits2[~inside]), what


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_changing_one_document_leaves_every_other_bit_identical(world_size, tmp_path):
    lengths = document_lengths(8 * (SEQ_LEN + 1) + 1)
    stream = make_stream(lengths)
    assert document_bounds(lengths)[2] == CHANGED and stream[CHANGED[1] - 1] == SEP
    changed = stream.clone()
    changed[CHANGED[0]:CHANGED[1] - 1] = (changed[CHANGED[0]:CHANGED[1] - 1] + 1) % SEP
    write_token_file(tmp_path / "a.bin", stream)
    write_token_file(tmp_path / "b.bin", changed)
    run_ranks(world_size, _one_document_changes_nothing_else, str(tmp_path / "a.bin"),
              str(tmp_path / "b.bin"))


def test_a_document_computes_the_same_bits_wherever_it_lands():
    """Rotary attention depends only on position differences, so within exact document masking
    positions that fail to restart change a document's numbers by rounding alone (the equivalence
    tests above, at 1e-5, cannot see it). Restarted positions make a document's outputs
    bit-identical wherever it lands in a window; positions counted from the window start do not."""
    model = llama.Transformer(llama.get_model_args("tiny"))
    llama.init_weights(model, 0)
    generator = torch.Generator().manual_seed(0)
    doc = torch.cat([torch.randint(0, SEP, (9,), generator=generator), torch.tensor([SEP])])
    tokens = torch.randint(0, SEP, (2, SEQ_LEN + 1), generator=generator)
    tokens[0, 2], tokens[0, 3:13] = SEP, doc  # at 3 in row 0, at 17 in row 1
    tokens[1, 16], tokens[1, 17:27] = SEP, doc
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0], starts[:, 1:] = True, tokens[:, :-1] == SEP
    docs = documents_in_windows(tokens, starts, torch.zeros(2, dtype=torch.int64))
    with torch.no_grad():
        logits = model(tokens[:, :-1], docs.position_ids, cu_seqlens=docs.cu_seqlens)
        assert torch.equal(logits[0, 3:13], logits[1, 17:27])
        unrestarted = torch.arange(SEQ_LEN).expand(2, -1)
        logits = model(tokens[:, :-1], unrestarted, cu_seqlens=docs.cu_seqlens)
        assert not torch.equal(logits[0, 3:13], logits[1, 17:27])


def test_the_sharded_step_hands_the_model_document_positions_and_boundaries():
    """train.py's forward_backward (02's step with documents): each rank gets its slice of the
    documents' labels and positions and the whole batch's boundaries, unsharded."""
    tokens = torch.tensor([[5, 6, SEP, 7, SEP, 8, 9, 1, 2]])
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0, [0, 3, 5]] = True
    docs = documents_in_windows(tokens, starts, torch.zeros(1, dtype=torch.int64))
    seen = []
    weight = torch.ones((), requires_grad=True)

    def fake_model(input_ids, positions, labels, cu_seqlens=None):
        seen.append((positions.tolist(), labels.tolist(), cu_seqlens))
        return weight * 0

    for rank in range(2):
        train.forward_backward(fake_model, tokens, Runtime(sp_rank=rank, sp=2), documents=docs)
    I = llama.IGNORE_INDEX
    assert seen == [([[0, 1, 2, 0]], [[6, SEP, I, SEP]], (0, 3, 5, 8)),
                    ([[1, 0, 1, 2]], [[I, 9, 1, 2]], (0, 3, 5, 8))]


# ---------------------------------------------------------------------------------------------
# Bad input: a clear ValueError, nothing trained
# ---------------------------------------------------------------------------------------------

def _refused(monkeypatch, argv, match):
    def no_model(*_):
        raise AssertionError("a model was built for input that should have been refused")

    monkeypatch.setattr(train, "build_model", no_model)
    with pytest.raises(ValueError, match=match):
        train.train(train.parse_args(argv))


def test_bad_document_input_is_refused_before_training(tmp_path, monkeypatch):
    lengths = document_lengths(4 * (SEQ_LEN + 1))
    stream = make_stream(lengths)
    path = tmp_path / "t.bin"
    write_token_file(path, stream)
    common = ["--data", str(path), "--seq-len", str(SEQ_LEN), "--steps", "1", "--device", "cpu"]
    # a separator outside the vocabulary (tiny: 256 ids)
    _refused(monkeypatch, [*common, "--doc-sep", "256"], "outside the model's vocabulary")
    # documents, but the tiny preset has no EOS id and nothing else names a separator
    _refused(monkeypatch, [*common, "--documents"], "has no EOS id")
    # a boundary index that does not match the token file
    bad = torch.tensor([0, 5, 21], dtype=torch.int64)  # 5 does not follow a separator
    bad.numpy().astype("<i8").tofile(data_module.boundary_path(str(path)))
    _refused(monkeypatch, [*common, "--doc-sep", str(SEP)], "does not match the token file")
    torch.tensor([0, 20, 10**6]).numpy().astype("<i8").tofile(data_module.boundary_path(str(path)))
    _refused(monkeypatch, [*common, "--documents"], "past the")
    # a sidecar that contradicts the files or the model
    write_token_file(path, stream, sidecar={"dtype": "uint16", "vocab_size": 1000})
    _refused(monkeypatch, [*common, "--documents"], "vocabulary of 1000")
    write_token_file(path, stream, sidecar={"dtype": "uint16", "separator_id": 3})
    _refused(monkeypatch, [*common, "--doc-sep", str(SEP)], "separated with 3")


def test_presets_name_their_eos():
    assert llama.get_model_args("llama3-8b").eos_id == 128001
    assert llama.get_model_args("qwen3-32b").eos_id == 151643
    assert llama.get_model_args("tiny").eos_id is None


# ---------------------------------------------------------------------------------------------
# prepare_data.py: documents -> token file + boundary index + sidecar, read back by data.py
# ---------------------------------------------------------------------------------------------

def _local_tokenizer(folder) -> str:
    """A word-level tokenizer trained on a few strings, saved as folder/tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"])
    tokenizer.train_from_iterator(["the cat sat on the mat", "a dog ran far away", "hello world"],
                                  trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_prepare_data_writes_ids_past_uint16_as_uint32(tmp_path):
    """A vocabulary over 2^16 entries (Llama-3's 128,256) takes 4 bytes a token: ids past 65,535
    read back intact through the sidecar's dtype."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    prepare_data = importlib.import_module("prepare_data")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w69999 w5 w65536\nw65535 w2\n")
    out = str(tmp_path / "train.bin")
    summary = prepare_data.prepare(str(tmp_path / "tok"), [str(tmp_path / "a.txt")], out,
                                   txt_lines=True, progress=False)
    # lengths with the separator: 3 + 1 and 2 + 1
    assert (summary["length_min"], summary["length_max"], summary["documents"]) == (3, 4, 2)
    info = json.loads(open(out + ".json").read())
    assert info["dtype"] == "uint32" and info["separator_id"] == 1, info
    cfg = resolve_techniques(Config(model="tiny", seq_len=6, data=out, documents=True))
    tokens = TokenData(cfg, 70_000, 0, 1).batch(0)
    assert tokens.tolist() == [[69999, 5, 65536, 1, 65535, 2, 1]]


def test_prepare_data_writes_what_training_reads(tmp_path, capsys):
    prepare_data = importlib.import_module("prepare_data")
    tokenizer = _local_tokenizer(tmp_path / "tok")
    (tmp_path / "a.jsonl").write_text('{"text": "the cat sat on the mat"}\n{"text": ""}\n'
                                      '{"text": "hello"}\n')
    (tmp_path / "b.txt").write_text("a dog ran far away\n\nhello world the end\n")
    out = str(tmp_path / "data" / "train.bin")
    prepare_data.main(["--tokenizer", tokenizer, "--input", str(tmp_path / "a.jsonl"),
                       str(tmp_path / "b.txt"), "--output", out, "--txt-lines"])
    printed = capsys.readouterr().out
    assert "4 documents" in printed and "1 empty skipped" in printed and "p50" in printed
    info = json.loads(open(out + ".json").read())
    sep = info["separator_id"]
    assert info["dtype"] == "uint16" and info["documents"] == 4 and sep == 1
    ids = torch.from_numpy(np.fromfile(out, dtype="<u2").astype("int64"))
    assert info["tokens"] == len(ids) and int(ids[-1]) == sep
    # 6 + 1, 1 + 1, 5 + 1, 4 + 1 tokens ("end" is unknown: <unk>)
    starts = np.fromfile(out + ".docs", dtype="<i8").tolist()
    assert starts == [0, 7, 9, 15]
    # data.py reads it back: the separator from the sidecar, the boundaries from the index.
    cfg = resolve_techniques(Config(model="tiny", seq_len=19, data=out, documents=True))
    data = TokenData(cfg, 256, 0, 1)
    tokens = data.batch(0)
    docs = data.documents(0, tokens)
    assert data.separator == sep and docs.cu_seqlens == (0, 7, 9, 15, 19)
    assert docs.position_ids.tolist() == [list(range(7)) + [0, 1] + list(range(6)) + list(range(4))]
    # and train.py trains on it
    run = train.train(train.parse_args(["--data", out, "--documents", "--seq-len", "8",
                                        "--steps", "2", "--device", "cpu"]))
    assert [r["documents"] for r in run.history] == [2, 2]  # windows [0, 9) and [9, 18)
    assert all(np.isfinite(r["loss"]) for r in run.history)
    # a separator the tokenizer does not have, or outside it: clear errors
    with pytest.raises(ValueError, match="not a token"):
        prepare_data.prepare(tokenizer, [str(tmp_path / "b.txt")], out, separator="<eos>")
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        prepare_data.prepare(tokenizer, [str(tmp_path / "b.txt")], out, separator_id=10**6)
    # an earlier output is never replaced unasked, an input never written over
    before = open(out, "rb").read()
    with pytest.raises(ValueError, match="exists"):
        prepare_data.prepare(tokenizer, [str(tmp_path / "b.txt")], out)
    assert open(out, "rb").read() == before
    with pytest.raises(ValueError, match="one of the --input files"):
        prepare_data.prepare(tokenizer, [str(tmp_path / "b.txt")], str(tmp_path / "b.txt"))
    prepare_data.prepare(tokenizer, [str(tmp_path / "b.txt")], out, overwrite=True)


@pytest.mark.parametrize("bad", ["missing", "folder", "not_utf8"])
def test_prepare_data_bad_input_leaves_nothing_and_keeps_an_earlier_output(tmp_path, capsys, bad):
    """An input error is named (the file, what is wrong) and leaves no output behind, so the
    corrected rerun is not refused; with --overwrite an earlier output survives a failed run."""
    prepare_data = importlib.import_module("prepare_data")
    tokenizer = _local_tokenizer(tmp_path / "tok")
    good = tmp_path / "good.txt"
    good.write_text("the cat sat on the mat\n")
    path = tmp_path / bad
    if bad == "folder":
        path.mkdir()
    elif bad == "not_utf8":
        path.write_bytes("the cat sat".encode() + b"\xff\xfe here\n")
    out = tmp_path / "data" / "train.bin"
    with pytest.raises(SystemExit):
        prepare_data.main(["--tokenizer", tokenizer, "--input", str(good), str(path),
                           "--output", str(out)])
    error = capsys.readouterr().err
    assert error.startswith("error: ") and str(path) in error and "Errno" not in error
    assert {"missing": "does not exist", "folder": "not a file",
            "not_utf8": "not UTF-8"}[bad] in error
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no output, no partial file
    prepare_data.main(["--tokenizer", tokenizer, "--input", str(good), "--output", str(out)])
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    with pytest.raises(SystemExit):
        prepare_data.main(["--tokenizer", tokenizer, "--input", str(good), str(path),
                           "--output", str(out), "--overwrite"])
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before


@pytest.mark.parametrize("argv, message", [
    (["--output", "{tok}/tokenizer.json", "--overwrite"], "a file of the --tokenizer"),
    (["--output", "{tok}/tokenizer", "--overwrite"], "tokenizer.json', which is a file of the"),
    (["--output", "{d}/a.jsonl", "--overwrite"], "one of the --input files"),
    (["--output", ""], "--output is empty"),
    (["--output", "{d}/old", "--overwrite"], "is a folder"),
    (["--output", "{d}/new/"], "is a folder"),
    (["--output", "{d}/a.jsonl/x.bin"], "a.jsonl' is a file, not a folder"),
    (["--tokenizer", "{d}/a.jsonl", "--output", "{d}/x.bin"],
     "a.jsonl' is not a tokenizer.json the tokenizers library reads"),
], ids=["tokenizer_file", "tokenizer_folder_sidecar", "input", "empty", "folder",
        "trailing_slash", "under_a_file", "not_a_tokenizer"])
def test_prepare_data_refuses_an_output_before_tokenizing(tmp_path, capsys, monkeypatch, argv,
                                                           message):
    """An output that would destroy an input or the tokenizer (even with --overwrite), or that
    cannot be a file, and a tokenizer that is not one: `error: ...`, one line, before any
    document is read, every file as it was."""
    prepare_data = importlib.import_module("prepare_data")
    tokenizer = _local_tokenizer(tmp_path / "tok")
    (tmp_path / "a.jsonl").write_text('{"text": "the cat sat"}\n')
    (tmp_path / "old").mkdir()
    monkeypatch.setattr(prepare_data, "read_documents", lambda *args: pytest.fail("tokenized"))
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    argv = [a.replace("{tok}", tokenizer).replace("{d}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as stopped:
        prepare_data.main(["--tokenizer", tokenizer, "--input", str(tmp_path / "a.jsonl")] + argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and "Errno" not in err, err
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before


def test_prepare_data_replaces_its_own_output_in_the_tokenizer_folder(tmp_path, capsys):
    """A token file written into the tokenizer's folder is an output, not the tokenizer: a rerun
    with --overwrite replaces it (and its index and sidecar); the tokenizer's files stay."""
    prepare_data = importlib.import_module("prepare_data")
    tokenizer = _local_tokenizer(tmp_path / "tok")
    (tmp_path / "a.jsonl").write_text('{"text": "the cat sat"}\n')
    out = str(tmp_path / "tok" / "train.bin")
    argv = ["--tokenizer", tokenizer, "--input", str(tmp_path / "a.jsonl"), "--output", out]
    prepare_data.main(argv)
    tokenizer_files = {p: p.read_bytes() for p in (tmp_path / "tok").iterdir()
                       if not p.name.startswith("train.bin")}
    prepare_data.main(argv + ["--overwrite"])
    assert "wrote" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in tokenizer_files} == tokenizer_files


def test_prepare_data_separator_id_range_blank_jsonl_lines_and_neighbours(tmp_path):
    """--separator-id one past the tokenizer's last id is refused, its last id taken; blank
    lines of a JSONL file are no documents (nor errors); a file already at the index's or the
    sidecar's name is not replaced unasked."""
    import tokenizers

    prepare_data = importlib.import_module("prepare_data")
    tokenizer = _local_tokenizer(tmp_path / "tok")
    vocab = len(json.load(open(f"{tokenizer}/tokenizer.json"))["model"]["vocab"])
    assert vocab == tokenizers.Tokenizer.from_file(f"{tokenizer}/tokenizer.json").get_vocab_size()
    docs = tmp_path / "a.jsonl"
    docs.write_text('\n{"text": "the cat"}\n\n   \n{"text": "hello"}\n\n')
    out = str(tmp_path / "train.bin")
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        prepare_data.prepare(tokenizer, [str(docs)], out, separator_id=vocab, progress=False)
    assert not (tmp_path / "train.bin").exists()
    summary = prepare_data.prepare(tokenizer, [str(docs)], out, separator_id=vocab - 1,
                                   progress=False)
    assert summary["documents"] == 2 and summary["skipped_empty"] == 0
    ids = np.fromfile(out, dtype="<u2").tolist()
    assert len(ids) == 5 and ids[2] == ids[4] == vocab - 1  # "the cat" SEP "hello" SEP
    assert np.fromfile(out + ".docs", dtype="<i8").tolist() == [0, 3]
    for name in ("other.bin.docs", "other.bin.json"):
        mine = tmp_path / name
        mine.write_text("not an output of prepare_data")
        with pytest.raises(ValueError, match="exists"):
            prepare_data.prepare(tokenizer, [str(docs)], str(tmp_path / "other.bin"),
                                 progress=False)
        assert mine.read_text() == "not an output of prepare_data"
        assert not (tmp_path / "other.bin").exists()
        mine.unlink()
