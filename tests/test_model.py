"""model.py: the compact Llama computes what the textbook formulas say."""

import math

import pytest
import torch

from base import kernels
import model as llama


def explicit_causal_attention(q, k, v):
    """softmax(q k^T / sqrt(D) + causal mask) v, one query head at a time, GQA by index."""
    batch, seq_len, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    out = torch.empty_like(q)
    mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)
    for h in range(n_heads):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(-1, -2) / math.sqrt(head_dim)
        out[:, :, h] = torch.softmax(scores + mask, dim=-1) @ v[:, :, h // group]
    return out


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_attention_matches_explicit_softmax(n_heads, n_kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 17, n_heads, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 17, n_kv_heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(kernels.causal_attention(q, k, v),
                               explicit_causal_attention(q, k, v))


def test_rotary_with_global_positions_equals_slicing_the_full_sequence():
    args = llama.get_model_args("tiny")
    x = torch.randn(1, 32, 3, args.head_dim)
    full = llama.apply_rope(x, *llama.rope_cos_sin(torch.arange(32)[None], args, x.dtype))
    shard = slice(16, 24)
    cos_sin = llama.rope_cos_sin(torch.arange(32)[None, shard], args, x.dtype)
    torch.testing.assert_close(llama.apply_rope(x[:, shard], *cos_sin), full[:, shard])
    # and it is a rotation: norms kept, position 0 untouched
    torch.testing.assert_close(full.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(full[:, 0], x[:, 0])


def test_rms_norm_is_the_textbook_formula_with_fp32_statistics():
    """x / sqrt(mean(x^2) + eps) * weight: eps inside the root (at the embeddings' 0.02-ish
    scale rms^2 is near eps, so its place shows), and for bf16 input the statistics in fp32 with
    one rounding at the end (bf16 statistics round several times: over 2 half-ulps here)."""
    g = torch.Generator().manual_seed(0)
    norm = llama.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x = torch.randn(4, 16, 64, generator=g, dtype=torch.float64) * 3e-3

    def textbook(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    torch.testing.assert_close(norm(x.float()).double(), textbook(x, norm.weight.double()),
                               rtol=1e-5, atol=0)
    norm.bfloat16()
    x = x.bfloat16()
    want = textbook(x.double(), norm.weight.double())
    half_ulp = 2.0**-8  # bf16's relative rounding error
    torch.testing.assert_close(norm(x).double(), want, rtol=1.25 * half_ulp, atol=0)


def test_llama3_frequency_scaling():
    args = llama.get_model_args("llama3-8b")
    scaled, plain = llama.rope_frequencies(args), llama.rope_frequencies(
        llama.ModelArgs(rope_scaling="none"))
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    torch.testing.assert_close(scaled[high], plain[high])  # short wavelengths kept
    torch.testing.assert_close(scaled[low], plain[low] / 8)  # long ones slowed 8x
    mid = ~(high | low)
    assert mid.any() and ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


@pytest.mark.parametrize("name", list(llama.PRESETS))
def test_parameter_count_from_shapes(name):
    args = llama.get_model_args(name)
    with torch.device("meta"):
        model = llama.Transformer(args)
    assert llama.num_params(args) == sum(p.numel() for p in model.parameters())


def test_published_sizes():
    assert round(llama.num_params(llama.get_model_args("llama3-8b")) / 1e9, 2) == 8.03
    assert round(llama.num_params(llama.get_model_args("llama3-70b")) / 1e9, 1) == 70.6
    assert round(llama.num_params(llama.get_model_args("qwen3-32b")) / 1e9, 1) == 32.8
    # tied input/output embeddings: counted once
    assert round(llama.num_params(llama.get_model_args("llama3.2-1b")) / 1e9, 2) == 1.24
    assert round(llama.num_params(llama.get_model_args("llama3.2-3b")) / 1e9, 2) == 3.21
    assert round(llama.num_params(llama.get_model_args("qwen3-0.6b")) / 1e9, 3) == 0.596


def test_a_single_process_build_computes_in_the_dtype_asked():
    """--dtype bfloat16 without FSDP (one process): support/build.py casts the built model, so
    its parameters are bf16 and its blocks compute in bf16 (not fp32 at twice the memory);
    fp32 stays fp32."""
    from support import build

    args = llama.get_model_args("tiny")
    for dtype in (torch.bfloat16, torch.float32):
        model = build.build_model(args, torch.device("cpu"), None, dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}, dtype
        seen = []
        model.layers[-1].register_forward_hook(lambda module, inputs, out: seen.append(out.dtype))
        ids, pos = torch.randint(0, args.vocab_size, (1, 8)), torch.arange(8)[None]
        with torch.no_grad():
            model(ids, pos, ids)
        assert seen == [dtype], dtype


def test_tied_embeddings_are_one_parameter_even_after_to_empty():
    """support/build.py builds on the meta device then calls to_empty, which gives each
    module a new Parameter: the tie must survive it."""
    from dataclasses import replace

    from support import build

    args = replace(llama.get_model_args("tiny"), tie_word_embeddings=True)
    with torch.device("meta"):
        model = llama.Transformer(args)
    build.allocate(model, "cpu")  # to_empty, and the tie again
    llama.init_weights(model)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == llama.num_params(args)
    ids, pos = torch.randint(0, args.vocab_size, (1, 8)), torch.arange(8)[None]
    model(ids, pos, ids).backward()  # both uses add into one gradient
    assert model.embed_tokens.weight.grad is model.lm_head.weight.grad


def test_weight_names_are_the_hugging_face_layout():
    """A Hugging Face Llama/Qwen3 state dict with the leading 'model.' removed loads as is."""
    with torch.device("meta"):
        model = llama.Transformer(llama.get_model_args("qwen3-32b"))
    keys = set(model.state_dict())
    layer = {f"layers.0.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "post_attention_layernorm")}
    assert layer | {"embed_tokens.weight", "norm.weight", "lm_head.weight"} <= keys
    assert model.layers[0].self_attn.q_proj.weight.shape == (64 * 128, 5120)  # heads in row blocks


def test_pretrained_weights_round_trip():
    args = llama.get_model_args("tiny")
    source, target = llama.Transformer(args), llama.Transformer(args)
    llama.init_weights(source, seed=1)
    target.load_state_dict(source.state_dict())
    ids = torch.randint(0, args.vocab_size, (1, 16))
    pos = torch.arange(16)[None]
    torch.testing.assert_close(target(ids, pos), source(ids, pos))


def test_loss_is_mean_cross_entropy_and_ignores_labels():
    args = llama.get_model_args("tiny")
    model = llama.Transformer(args)
    llama.init_weights(model)
    ids = torch.randint(0, args.vocab_size, (2, 16))
    labels = torch.randint(0, args.vocab_size, (2, 16))
    labels[0, :5] = llama.IGNORE_INDEX
    pos = torch.arange(16).expand(2, -1)
    logits = model(ids, pos)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             reduction="sum")
    torch.testing.assert_close(model(ids, pos, labels), want)
    assert model(ids, pos, torch.full_like(labels, llama.IGNORE_INDEX)).item() == 0.0


def test_init_is_reproducible_and_sane():
    args = llama.get_model_args("tiny")
    a, b = llama.Transformer(args), llama.Transformer(args)
    llama.init_weights(a, seed=3)
    llama.init_weights(b, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.equal(a.norm.weight, torch.ones(args.dim))
    assert 0.015 < a.lm_head.weight.std() < 0.025


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="unknown model preset 'llama5'"):
        llama.get_model_args("llama5")


def test_kernel_name_is_reported():
    assert kernels.attention_kernel_name(torch.device("cpu"), torch.float32) == "CPU (SDPA)"


def test_fast_init_gives_every_shard_its_own_values():
    """exact=False (the big presets) draws each rank's shard itself: two shards of one
    parameter, or two parameters of one shape, must not repeat each other, and the seed counts."""
    from types import SimpleNamespace

    from support import build

    args = llama.get_model_args("tiny")
    model = llama.Transformer(args)
    llama.init_weights(model, seed=5, exact=False)
    a, b = model.layers[0].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight
    assert not torch.equal(a, b) and 0.015 < a.std() < 0.025
    # Two ranks holding shards of the same parameter: fake DTensors that report their rank.
    shards = []
    for rank in range(2):
        local = torch.empty(4, 8)
        param = SimpleNamespace(to_local=lambda local=local: local,
                                device_mesh=SimpleNamespace(get_local_rank=lambda rank=rank: rank))
        fake = SimpleNamespace(named_parameters=lambda param=param: [("w.weight", param)])
        build.init_sharded_weights(fake, seed=5, exact=False)
        shards.append(local)
    assert not torch.equal(shards[0], shards[1])
    again = llama.Transformer(args)
    llama.init_weights(again, seed=5, exact=False)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
