"""base/fused.py: SwiGLU (with down_proj) and rotary as model.py writes them, one elementwise
kernel each way on CUDA, and what the MLP no longer keeps. (Every equivalence test also compares
a built model, which runs these, against model.py's plain one.)"""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model as llama
from base import fused
from reference import assert_within_bf16_error
from support import build, byte_counts


def _inputs(dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up, grad_act = (torch.randn(3, 40, 24, generator=g, dtype=torch.float64) * 3
                          for _ in range(3))
    weight = torch.randn(10, 24, generator=g, dtype=torch.float64) / 5  # down_proj's
    grad = torch.randn(3, 40, 10, generator=g, dtype=torch.float64)
    x = torch.randn(2, 40, 4, 16, generator=g, dtype=torch.float64)
    grad_x = torch.randn(2, 40, 4, 16, generator=g, dtype=torch.float64)
    args = llama.ModelArgs(head_dim=16, rope_theta=10000.0, rope_scaling="none")
    cos, sin = llama.rope_cos_sin(torch.arange(1000, 1040).expand(2, -1), args, torch.float64)
    return [t.to(device, dtype) for t in (gate, up, weight, grad, grad_act, x, grad_x, cos, sin)]


def _plain_down(gate, up, weight):
    """model.MLP's tail: down_proj(swiglu_act(gate, up))."""
    return torch.nn.functional.linear(llama.swiglu_act(gate, up), weight)


def _plain_and_fused(gate, up, weight, grad, grad_act, x, grad_x, cos, sin) -> tuple:
    """Outputs and input gradients of model.py's forms (autograd) and of base/fused.py's."""
    results = []
    for down, rotary in ((_plain_down, llama.apply_rope),
                         (fused.SwiGLUDown.apply, fused.rotary)):
        g, u, w, r = (t.detach().clone().requires_grad_() for t in (gate, up, weight, x))
        out, rotated = down(g, u, w), rotary(r, cos, sin)
        torch.autograd.backward((out, rotated), (grad, grad_x))
        results.append({"mlp": out.detach(), "d_gate": g.grad, "d_up": u.grad,
                        "d_down_weight": w.grad, "rotary": rotated.detach(), "d_x": r.grad})
    return tuple(results)


def test_fused_forms_equal_model_py_and_their_gradients_are_exact():
    plain, mine = _plain_and_fused(*_inputs())
    for name, want in plain.items():
        torch.testing.assert_close(mine[name], want, rtol=1e-6, atol=1e-6, msg=name)
    # what CUDA compiles (the formulas) equals what runs op by op here (in place)
    gate, up, _, _, grad_act = _inputs()[:5]
    torch.testing.assert_close(fused._swiglu(gate, up), fused._swiglu_in_place(gate, up))
    for a, b in zip(fused._swiglu_backward(grad_act, gate, up),
                    fused._swiglu_backward_in_place(grad_act, gate, up)):
        torch.testing.assert_close(a, b)
    # the backward formulas themselves, against finite differences in float64 (a slice of each:
    # gradcheck perturbs every input element)
    gate, up, _, _, _, x, _, cos, sin = (t[:1, :6].clone() for t in _inputs(torch.float64))
    weight = _inputs(torch.float64)[2][:4, :].clone()
    leaves = (gate.requires_grad_(), up.requires_grad_(), weight.requires_grad_())
    assert torch.autograd.gradcheck(fused.SwiGLUDown.apply, leaves)
    assert torch.autograd.gradcheck(lambda t: fused.rotary(t, cos, sin), (x.requires_grad_(),))


def test_swiglu_down_gives_gate_or_up_its_gradient_when_the_other_needs_none():
    """SwiGLUDown with only one of gate and up requiring a gradient (down_proj's weight frozen):
    that one still gets model.py's gradient, not None."""
    gate, up, weight, grad = _inputs(torch.float64)[:4]
    for needs in ("gate", "up"):
        inputs = {"gate": gate.clone(), "up": up.clone()}
        leaf = inputs[needs].requires_grad_()
        want, = torch.autograd.grad(_plain_down(inputs["gate"], inputs["up"], weight), leaf, grad)
        got, = torch.autograd.grad(fused.SwiGLUDown.apply(inputs["gate"], inputs["up"], weight),
                                   leaf, grad, allow_unused=True)
        assert got is not None, needs
        torch.testing.assert_close(got, want, msg=needs)


def test_a_built_model_runs_them_and_its_mlp_keeps_two_activations_less():
    """The build installs both seams; an untiled block's MLP then keeps gate and up
    (2 x tokens x ffn_dim, the planner's count), where model.py's plain one keeps silu(gate)
    and down_proj's input too (4): neither exists past the forward."""
    args = llama.get_model_args("tiny")
    built = build.build_model(args, torch.device("cpu"))
    assert all(block.mlp.forward.func is fused.mlp_forward
               and block.self_attn.rotary is fused.rotary for block in built.layers)
    plain = llama.Transformer(args)
    plain.load_state_dict(built.state_dict())
    tokens = 64
    x = torch.randn(1, tokens, args.dim)
    kept = []
    for model in (plain, built):
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        mlp = model.layers[0].mlp
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mlp(x.clone().requires_grad_())
        weights = sum(p.nbytes for p in mlp.parameters())
        kept.append(sum(saved.values()) - weights - x.nbytes)  # less its weights and input
    activation = tokens * args.ffn_dim * 4
    assert kept[0] - kept[1] == 2 * activation
    assert kept[1] == byte_counts.mlp_temporary_bytes(args, tokens, False, bytes_per_value=4,
                                                      saved_only=True)


def test_under_checkpointing_down_proj_runs_forward_once(monkeypatch):
    """03's recompute reruns a block only to rebuild what it saves; SwiGLUDown's output feeds
    nothing there, so the recompute skips down_proj and the step still matches: per checkpointed
    block silu(gate) * up is computed twice (the forward, and the backward for down_proj's
    weight gradient), not three times, and down_proj's product over the tokens once, as
    without checkpointing (step_time.step_flops counts gate and up recomputed, not down)."""
    checkpointing = importlib.import_module("03_checkpoint_offload")
    args = llama.get_model_args("tiny")
    calls = []
    swiglu_forward = fused.swiglu_forward
    monkeypatch.setattr(fused, "swiglu_forward",
                        lambda *a: calls.append("act") or swiglu_forward(*a))
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    positions = torch.arange(16).expand(2, -1)
    results = {}
    for checkpointed in (False, True):
        model = build.build_model(args, torch.device("cpu"))
        if checkpointed:
            checkpointing.apply_checkpointing(model)
        calls.clear()
        with DownProducts(model) as products:
            model(tokens, positions, tokens).backward()
        results[checkpointed] = (len(calls), products.count,
                                 [p.grad for p in model.parameters()])
    plain, checkpointed = results[False], results[True]
    assert plain[:2] == checkpointed[:2] == (2 * args.n_layers, args.n_layers), results
    for want, got in zip(plain[2], checkpointed[2]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class DownProducts(TorchDispatchMode):
    """Counts down_proj's forward product: (tokens, ffn_dim) @ a down_proj weight transposed,
    (ffn_dim, dim); its backward's products take the weight as it is, or not at all."""

    def __init__(self, model):
        super().__init__()
        self.weights = {block.mlp.down_proj.weight.untyped_storage().data_ptr()
                        for block in model.layers}
        self.shape = tuple(model.layers[0].mlp.down_proj.weight.shape[::-1])  # (ffn_dim, dim)
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            a, b = args[-2:]
            self.count += (b.untyped_storage().data_ptr() in self.weights
                           and tuple(b.shape) == self.shape)
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_one_kernel_each_way_within_the_bf16_rule():
    """On CUDA in bf16: each form's forward is one kernel and its backward one, and the results
    stay within the one bf16 rule of the fp32 plain forms (compiled: computed in fp32 and rounded
    once); also after a dispatch mode saw them first (another test's op counter, in the same
    process: dynamo compiles nothing under one, and torch 2.11 then left them uncompiled); and
    compiled once per width, not per sequence length."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()  # as in a fresh process: the dispatch mode meets the forms first
    fused._compiled.clear()
    with Passing():
        _plain_and_fused(*_inputs(torch.bfloat16, "cuda"))
    before = counters["stats"]["unique_graphs"]
    for heads, seq_len in ((3, 64), (3, 96), (5, 64), (5, 128)):  # two widths, three lengths
        x = torch.randn(1, seq_len, heads, 16, device="cuda", dtype=torch.bfloat16)
        angles = torch.randn(1, seq_len, 8, device="cuda", dtype=torch.bfloat16)
        fused.rotate(x, angles.cos(), angles.sin())
    assert counters["stats"]["unique_graphs"] - before == 2, "rotary: one compile per width"
    reference, _ = _plain_and_fused(*_inputs(torch.float32))
    unsharded, mine = _plain_and_fused(*_inputs(torch.bfloat16, "cuda"))
    cpu = lambda d: {k: v.float().cpu() for k, v in d.items()}  # noqa: E731
    assert_within_bf16_error(cpu(mine), cpu(unsharded), reference, "fused forms")
    gate, up, weight, grad, grad_act, x, grad_x, cos, sin = _inputs(torch.bfloat16, "cuda")
    g, u, w, r = (t.requires_grad_() for t in (gate, up, weight, x))

    def launched_by(run) -> list:
        """The CUDA kernels of run() after a first, compiling and warming, call."""
        run()
        g.grad = u.grad = w.grad = r.grad = None  # no accumulation into an existing .grad below
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        g.grad = u.grad = w.grad = r.grad = None
        return [e.name for e in prof.events() if e.device_type.name == "CUDA"]

    runs = {"swiglu forward": (lambda: fused.swiglu_forward(g, u), 1),
            "swiglu backward": (lambda: fused.swiglu_backward(grad_act, g, u), 1),
            "rotary forward": (lambda: fused.rotary(r, cos, sin), 1),
            "rotary forward + backward": (lambda: fused.rotary(r, cos, sin).backward(grad_x), 2)}
    for what, (run, most) in runs.items():
        launched = launched_by(run)
        assert len(launched) <= most, (what, launched)
    # SwiGLUDown: the activation's kernel forward, and in backward again, then its derivative's
    # (the rest are down_proj's matmuls)
    for what, run, compiled in (
            ("SwiGLUDown forward", lambda: fused.SwiGLUDown.apply(g, u, w), 1),
            ("SwiGLUDown forward + backward",
             lambda: fused.SwiGLUDown.apply(g, u, w).backward(grad), 3)):
        launched = launched_by(run)
        assert sum(name.startswith("triton") for name in launched) == compiled, (what, launched)


def _logits_and_labels(dtype=torch.float32, device="cpu", tokens=37, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::5] = llama.IGNORE_INDEX  # some rows count for nothing
    return logits.to(device, dtype), labels.to(device)


def _losses_and_gradients(logits, labels, grad=1.7) -> list:
    """(loss, d logits) of model.cross_entropy_sum (autograd) and of base/fused.py's form."""
    results = []
    for cross_entropy in (llama.cross_entropy_sum, fused.cross_entropy):
        leaf = logits.detach().clone().requires_grad_()
        loss = cross_entropy(leaf, labels)
        (loss * grad).backward()
        results.append((loss.detach(), leaf.grad))
    return results


def test_fused_cross_entropy_equals_model_py_and_keeps_the_logits_in_their_own_dtype():
    """The loss seam's fused form: model.py's summed cross-entropy and its gradient (ignored
    rows too, and all of them: 0, not NaN); its two forms (compiled on CUDA, in place here)
    agree; float64 finite differences; and in bf16 its statistics are fp32 as model.py's, and
    it keeps the logits as they are (2 bytes each) where model.py's keeps their fp32
    log-softmax (4)."""
    assert fused.IGNORE_INDEX == llama.IGNORE_INDEX
    logits, labels = _logits_and_labels()
    (want, want_grad), (loss, grad) = _losses_and_gradients(logits, labels)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)
    assert grad[::5].abs().max() == 0  # an ignored row gets no gradient
    ignored = torch.full_like(labels, llama.IGNORE_INDEX)
    (want, want_grad), (loss, grad) = _losses_and_gradients(logits, ignored)
    assert want == loss == 0 and grad.abs().max() == 0 and not grad.isnan().any()
    scale = torch.tensor(1.7)
    torch.testing.assert_close(fused._cross_entropy_backward(logits, labels, scale),
                               fused._cross_entropy_backward_in_place(logits, labels, scale))
    small, small_labels = _logits_and_labels(torch.float64, tokens=6, vocab=7)
    assert torch.autograd.gradcheck(lambda t: fused.cross_entropy(t, small_labels),
                                    (small.clone().requires_grad_(),))
    # What each keeps for backward, in bf16 (the built model installs the fused form)
    built = build.build_model(llama.get_model_args("tiny"), torch.device("cpu"))
    assert built.cross_entropy is fused.cross_entropy
    logits = logits.to(torch.bfloat16)
    # bf16 logits: the statistics in fp32 as model.py's (a bf16 log-sum-exp rounds to 3 digits)
    loss, want = fused.cross_entropy(logits, labels), llama.cross_entropy_sum(logits, labels)
    assert loss.dtype == want.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-5)
    kept = []
    for cross_entropy in (llama.cross_entropy_sum, fused.cross_entropy):
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cross_entropy(logits.clone().requires_grad_(), labels)
        kept.append(sum(n for n in saved.values() if n >= logits.numel()))  # tokens x vocab
    assert kept == [logits.numel() * 4, logits.numel() * 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_cross_entropy_within_the_bf16_rule_in_few_kernels_and_4_bytes_per_logit():
    """On CUDA in bf16 the fused cross-entropy stays within the bf16 rule of the fp32 plain
    loss, runs in at most two kernels each way (a row reduction and the sum; the backward's
    log-sum-exp and gradient), and holds the logits and their bf16 gradient at its peak, 4
    bytes per logit (the planner's count, support/byte_counts.py), where model.py's holds 12."""
    from torch.profiler import ProfilerActivity, profile

    logits, labels = _logits_and_labels(tokens=2048, vocab=32768)
    reference = _losses_and_gradients(logits, labels)[0]
    plain, mine = _losses_and_gradients(logits.to("cuda", torch.bfloat16), labels.cuda())
    as_dict = lambda pair: {"loss": pair[0].float().cpu(), "grad": pair[1].float().cpu()}  # noqa
    assert_within_bf16_error(as_dict(mine), as_dict(plain), as_dict(reference),
                             "fused cross-entropy")
    logits, labels = logits.to("cuda", torch.bfloat16).requires_grad_(), labels.cuda()
    extra = {}
    for name, cross_entropy in (("plain", llama.cross_entropy_sum), ("fused", fused.cross_entropy)):
        cross_entropy(logits, labels).backward()  # compiled and warmed
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cross_entropy(logits, labels).backward()
        extra[name] = (torch.cuda.max_memory_allocated() - base) / logits.numel()
        logits.grad = None
    assert extra["fused"] <= 2 * 2 + 0.1, extra  # the gradient (2) and the backward's input (2)
    assert extra["plain"] >= 12, extra
    one = torch.ones((), device="cuda")
    loss = None

    def forward():
        nonlocal loss
        loss = fused.cross_entropy(logits, labels)

    for what, run in (("forward", forward), ("backward", lambda: loss.backward(one))):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        launched = [e.name for e in prof.events() if e.device_type.name == "CUDA"
                    and "memset" not in e.name.lower()]
        assert len(launched) <= 2, (what, launched)


def test_fused_logit_scores_equal_model_py_and_a_built_model_evaluates_through_them():
    """Evaluation's per-token seam: each row's cross-entropy (0 where ignored) and argmax id
    as model.py's, and the built model's token_scores runs base/fused.py's form."""
    logits, labels = _logits_and_labels()
    want, mine = llama.logit_scores(logits, labels), fused.logit_scores(logits, labels)
    torch.testing.assert_close(mine, want, rtol=1e-6, atol=1e-6)
    assert mine[::5, 0].abs().max() == 0 and torch.equal(mine[:, 1], logits.argmax(1).float())
    built = build.build_model(llama.get_model_args("tiny"), torch.device("cpu"))
    assert built.logit_scores is fused.logit_scores
    plain = llama.Transformer(built.args)
    plain.load_state_dict(built.state_dict())
    h = torch.randn(2, 8, built.args.dim)
    token_labels = torch.randint(0, built.args.vocab_size, (2, 8))
    token_labels[0, :3] = llama.IGNORE_INDEX
    with torch.no_grad():
        torch.testing.assert_close(built.token_scores(h, token_labels),
                                   plain.token_scores(h, token_labels), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_logit_scores_in_one_kernel_holding_only_the_bf16_logits():
    """On CUDA in bf16: the losses within the bf16 rule of fp32 (model.py's form of the same
    bf16 logits as the unsharded bf16 run), the argmax ids exact, one kernel, and nothing
    tokens x vocab allocated beyond the logits (the planner's count for evaluation's forward,
    plan.plan_forward_memory) where model.py's form holds 8 more bytes per logit."""
    from torch.profiler import ProfilerActivity, profile

    logits, labels = _logits_and_labels(tokens=2048, vocab=32768)
    reference = llama.logit_scores(logits, labels)
    low, cuda_labels = logits.to("cuda", torch.bfloat16), labels.cuda()
    plain, mine = llama.logit_scores(low, cuda_labels), fused.logit_scores(low, cuda_labels)
    assert_within_bf16_error({"losses": mine[:, 0].cpu()}, {"losses": plain[:, 0].cpu()},
                             {"losses": reference[:, 0]}, "fused logit scores")
    assert torch.equal(mine[:, 1], low.argmax(1).float())
    extra = {}
    for name, scores in (("plain", llama.logit_scores), ("fused", fused.logit_scores)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        scores(low, cuda_labels)
        extra[name] = (torch.cuda.max_memory_allocated() - base) / low.numel()
    assert extra["fused"] <= 0.1 and extra["plain"] >= 7.9, extra
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused.logit_scores(low, cuda_labels)
        torch.cuda.synchronize()
    launched = [e.name for e in prof.events() if e.device_type.name == "CUDA"
                and "memset" not in e.name.lower()]
    assert len(launched) <= 2, launched
