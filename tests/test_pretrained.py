"""pretrained.py: Hugging Face checkpoints in and out, checked against transformers itself.

No hub: each test makes a tiny model with transformers' config classes and `save_pretrained`s it
into a temporary folder (fp32). Sequences (96) are longer than the original context (32), so the
rotary scalings' stretched band is exercised.
"""

import importlib
import json
import os
import stat
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import model as llama
from support import build, pretrained
from ranks import run_ranks
from support.config import Config, model_args
from support.runtime import Runtime

transformers = pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEQ, ORIGINAL = 96, 32
CPU = torch.device("cpu")

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
              rms_norm_eps=1e-5)
ROPE = {
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": ORIGINAL},
    "yarn-explicit": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                      "original_max_position_embeddings": ORIGINAL, "beta_fast": 16.0,
                      "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False},
    "default": {"rope_type": "default", "rope_theta": 1000000.0},
}
CASES = {  # name: (architecture, rope, tied)
    "llama-llama3": ("llama", "llama3", False),
    "llama-yarn": ("llama", "yarn", False),
    "llama-yarn-explicit": ("llama", "yarn-explicit", False),
    "qwen3-qknorm": ("qwen3", "default", False),
    "llama-tied": ("llama", "llama3", True),
    "qwen3-tied-yarn": ("qwen3", "yarn", True),
}


def make_hf_model(path, case="llama-llama3", seed=0, **overrides):
    """A tiny transformers model saved in `path`; norms perturbed from 1 so they are tested too."""
    family, rope, tied = CASES[case]
    config_cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    model_cls = (transformers.Qwen3ForCausalLM if family == "qwen3"
                 else transformers.LlamaForCausalLM)
    config = config_cls(**{**COMMON, "rope_parameters": dict(ROPE[rope]),
                           "tie_word_embeddings": tied, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = model_cls(config).float()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    hf.save_pretrained(path)
    return hf


def batch(vocab=256, rows=2, seq=SEQ, seed=0):
    """ids (rows, seq); HF labels (= ids, HF shifts inside); ours pre-shifted, some ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    hf_labels = ids.clone()
    hf_labels[torch.rand(ids.shape, generator=g) < 0.2] = -100
    ours = torch.full_like(ids, llama.IGNORE_INDEX)
    ours[:, :-1] = hf_labels[:, 1:]
    return ids, torch.arange(seq).expand(rows, -1), hf_labels, ours


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def our_name(hf_name):
    return hf_name.removeprefix("model.")


# ---------------------------------------------------------------------------------------------
# Our model computes what transformers computes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_gradients_equal_transformers(tmp_path, case):
    hf = make_hf_model(tmp_path, case)
    model, args = build.build_from_hf(str(tmp_path), CPU)
    assert args.tie_word_embeddings == CASES[case][2]
    assert args.qk_norm == (CASES[case][0] == "qwen3")
    if args.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    ids, pos, hf_labels, labels = batch()

    assert rel_err(model(ids, pos), hf(ids).logits) < 1e-5

    hf_out = hf(ids, labels=hf_labels)
    hf_out.loss.backward()
    count = (labels != llama.IGNORE_INDEX).sum()
    loss = model(ids, pos, labels) / count  # ours: summed over labels; HF: the mean
    loss.backward()
    assert loss.item() == pytest.approx(hf_out.loss.item(), rel=1e-5)
    ours = dict(model.named_parameters())
    hf_params = dict(hf.named_parameters())
    assert {hf_name if hf_name == "lm_head.weight" else our_name(hf_name)
            for hf_name in hf_params} == set(ours)
    for hf_name, param in hf_params.items():
        mine = ours[hf_name if hf_name == "lm_head.weight" else our_name(hf_name)]
        assert rel_err(mine.grad, param.grad) < 1e-5, hf_name


def test_rotary_frequencies_equal_transformers():
    """Each scaling's inverse frequencies and attention factor, bit for bit, on real widths."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in ("llama3", "yarn", "yarn-explicit"):
        config = transformers.LlamaConfig(**{**COMMON, "head_dim": 128,
                                             "rope_parameters": dict(ROPE[rope])})
        want, factor = ROPE_INIT_FUNCTIONS[ROPE[rope]["rope_type"]](config, CPU)
        args = pretrained.model_args_from_hf({**config.to_dict(),
                                              "architectures": ["LlamaForCausalLM"]})
        assert torch.equal(llama.rope_frequencies(args), want), rope
        assert llama.rope_attention_factor(args) == pytest.approx(factor, rel=1e-12), rope


YARN_DERIVED = {
    # beta_fast and beta_slow left out (32 and 1): at an original context of 8K they decide which
    # dimensions blend (at ORIGINAL's 32 tokens every dimension is stretched, whatever they are)
    "yarn-8k-default-betas": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                              "original_max_position_embeddings": 8192},
    # no attention_factor: derived from mscale and mscale_all_dim
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": ORIGINAL, "mscale": 1.0,
                    "mscale_all_dim": 0.5},
}


@pytest.mark.parametrize("rope", list(YARN_DERIVED))
def test_yarn_settings_left_to_derive_equal_transformers(rope):
    """yarn's inverse frequencies and attention factor where the config leaves them to be
    derived (default betas at a real original context; the factor from mscale), bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = YARN_DERIVED[rope]
    context = int(parameters["original_max_position_embeddings"] * parameters["factor"])
    config = transformers.LlamaConfig(**{**COMMON, "head_dim": 128,
                                         "max_position_embeddings": context,
                                         "rope_parameters": dict(parameters)})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, CPU)
    args = pretrained.model_args_from_hf({**config.to_dict(),
                                          "architectures": ["LlamaForCausalLM"]})
    assert torch.equal(llama.rope_frequencies(args), want)
    assert llama.rope_attention_factor(args) == pytest.approx(factor, rel=1e-12)
    assert factor != pytest.approx(1.0)


def test_fields_a_config_leaves_out_are_read_as_transformers_reads_them():
    """A config.json written by hand, without num_key_value_heads, head_dim or rms_norm_eps:
    each read as transformers' config class reads it (Llama: every head its own K/V, head_dim
    hidden_size / heads; Qwen3: its own defaults, 32 KV heads of 128; both: eps 1e-6)."""
    left_out = ("num_key_value_heads", "head_dim", "rms_norm_eps")
    given = {k: v for k, v in COMMON.items() if k not in left_out}
    for family, config_class in (("Llama", transformers.LlamaConfig),
                                 ("Qwen3", transformers.Qwen3Config)):
        want = config_class(**given)
        args = pretrained.model_args_from_hf({**given, "architectures": [f"{family}ForCausalLM"]})
        assert (args.n_kv_heads, args.head_dim, args.norm_eps) == (
            want.num_key_value_heads, want.head_dim, want.rms_norm_eps), family
    llama = pretrained.model_args_from_hf({**given, "architectures": ["LlamaForCausalLM"]})
    assert (llama.n_kv_heads, llama.head_dim, llama.norm_eps) == (4, 16, 1e-6)


def test_the_first_of_several_end_tokens_separates_documents():
    """eos_token_id as a list (Llama 3.1 Instruct's [128001, 128008, 128009]): eos_id, packed
    documents' separator and the export's eos_token_id, is the first, <|end_of_text|>."""
    config = {**COMMON, "architectures": ["LlamaForCausalLM"]}
    for eos, want in (([128001, 128008, 128009], 128001), (128009, 128009), (None, None)):
        assert pretrained.model_args_from_hf({**config, "eos_token_id": eos}).eos_id == want


# train.py's --rope-* flags, other than the tiny preset's own rotary (llama3: factor 8, original
# 8192, theta 1e4). At head_dim 8 and theta 8000 the wavelengths 2 pi theta^(i/4) are 6, 59, 562
# and 5316 tokens: llama3 keeps the first (< 64/4), blends the second, stretches the others;
# yarn's ramp over dimensions 0-2 keeps, blends and stretches too. 96 tokens: past the 64.
ROPE_FLAGS = {scaling: ["--rope-scaling", scaling, "--rope-factor", "4",
                        "--rope-original-context", "64", "--rope-theta", "8000"]
              for scaling in ("llama3", "yarn")}
FLAGGED_SEQ = 96


def hf_rope_parameters(scaling: str) -> dict:
    """ROPE_FLAGS[scaling] in transformers' words (llama3's two band edges: Llama 3.1's, the
    model's defaults, which no flag sets)."""
    given = {"rope_type": scaling, "rope_theta": 8000.0, "factor": 4.0,
             "original_max_position_embeddings": 64}
    if scaling == "llama3":
        given.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return given


@pytest.mark.parametrize("scaling", list(ROPE_FLAGS))
def test_rotary_flags_equal_transformers_rotary_embedding(scaling):
    """The model train.py builds with the --rope-* flags: its cos and sin are transformers'
    LlamaRotaryEmbedding's for the same rope_parameters, and its logits transformers' Llama's
    with its weights (the flags reach the model, not only its arguments)."""
    import train

    cfg = train.parse_args(["--seq-len", str(FLAGGED_SEQ), *ROPE_FLAGS[scaling]])
    model = train.build_model(cfg, Runtime())
    args = model.args
    config = transformers.LlamaConfig(
        hidden_size=args.dim, intermediate_size=args.ffn_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps,
        max_position_embeddings=4 * 64, rope_parameters=hf_rope_parameters(scaling))
    config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(config).float()
    hf.load_state_dict({name if name == "lm_head.weight" else f"model.{name}": weight
                        for name, weight in model.state_dict().items()})
    ids, positions, _, _ = batch(seq=FLAGGED_SEQ)
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1, FLAGGED_SEQ, args.head_dim), positions)
    cos, sin = llama.rope_cos_sin(positions, args, torch.float32)  # half a head: both halves'
    torch.testing.assert_close(torch.cat([cos, cos], -1), hf_cos)
    torch.testing.assert_close(torch.cat([sin, sin], -1), hf_sin)
    with torch.no_grad():
        assert rel_err(model(ids, positions), hf(ids).logits) < 1e-5


def _rotary_flags_shard_like_one_process():
    """--stack 5 --sp 2 (05: each rank rotates its half of the sequence at its global positions,
    FSDP) with each scaling's flags: one step's loss and gradients are the plain model's with
    the same rotary settings, in one process."""
    from reference import assert_matches, make_batch, reference_loss_and_grads, train_loss_and_grads
    import train

    tokens, labels = make_batch(256, 2, FLAGGED_SEQ, ignore_frac=0.2)
    for scaling, flags in ROPE_FLAGS.items():
        cfg = train.parse_args(["--seq-len", str(FLAGGED_SEQ), "--batch-size", "2",
                                "--stack", "5", "--sp", "2", *flags])
        loss, grads = train_loss_and_grads(cfg, tokens, labels)
        ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels,
                                                       args=model_args(cfg))
        assert_matches(loss, grads, ref_loss, ref_grads, what=f"--stack 5 --sp 2 {scaling}")


def test_rotary_flags_under_sequence_shards_equal_one_process():
    run_ranks(2, _rotary_flags_shard_like_one_process)


def test_v4_style_config_reads_the_same(tmp_path):
    """transformers v4 wrote rope_theta at the top and rope_scaling (with "type" in old files)."""
    v4 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 96, "vocab_size": 256, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 128, "rope_theta": 10000.0,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    args = pretrained.model_args_from_hf(v4)
    assert (args.head_dim, args.rope_scaling, args.rope_theta, args.rope_factor,
            args.rope_original_context) == (16, "yarn", 10000.0, 4.0, 32)
    plain = pretrained.model_args_from_hf({**v4, "rope_scaling": None})
    assert plain.rope_scaling == "none" and not plain.tie_word_embeddings


# ---------------------------------------------------------------------------------------------
# Export: transformers opens it and computes what we compute; so do we
# ---------------------------------------------------------------------------------------------

def adamw_steps(model, steps=3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ids, pos, _, labels = batch(seed=10 + step)
        model(ids, pos, labels).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("case", ["llama-yarn", "qwen3-tied-yarn", "llama-tied", "qwen3-qknorm"])
def test_export_round_trip(tmp_path, case):
    make_hf_model(tmp_path / "in", case)
    model, args = build.build_from_hf(str(tmp_path / "in"), CPU)
    adamw_steps(model)
    out = tmp_path / "out"
    # several shards, so the index is exercised
    pretrained.export_hf(model, args, str(out), dtype=torch.float32, max_shard_bytes=100_000,
                         source_dir=str(tmp_path / "in"))
    files = sorted(os.listdir(out))
    assert "config.json" in files and pretrained.INDEX_NAME in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temp folders left
    config = json.loads((out / "config.json").read_text())
    # transformers v4 reads rope_theta + rope_scaling only: those alone mean the same rotary
    v4_view = {k: v for k, v in config.items() if k != "rope_parameters"}
    assert pretrained.model_args_from_hf(v4_view) == args
    assert pretrained.model_args_from_hf(config) == args

    ids, pos, _, _ = batch(seed=99)
    with torch.no_grad():
        want = model(ids, pos)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        assert type(hf).__name__ == ("Qwen3ForCausalLM" if args.qk_norm else "LlamaForCausalLM")
        assert hf.config.tie_word_embeddings == args.tie_word_embeddings
        assert rel_err(hf(ids).logits, want) < 1e-5
        again, again_args = build.build_from_hf(str(out), CPU)
        assert again_args == args
        assert torch.equal(again(ids, pos), want)


def test_export_keeps_yarn_s_given_attention_factor_and_truncate(tmp_path):
    """A yarn model whose config gives its attention factor (1.3) and truncate=False, exported:
    transformers opening the export rotates and scales as opening the original (left out of
    config.json, each would take its default) and computes the same logits. Its original
    context is 8K: at ORIGINAL's 32 tokens no dimension's correction range needs truncating."""
    rope = {**ROPE["yarn-explicit"], "rope_theta": 500000.0,
            "original_max_position_embeddings": 8192}
    hf = make_hf_model(tmp_path / "in", "llama-yarn-explicit", rope_parameters=rope,
                       max_position_embeddings=4 * 8192)
    model, args = build.build_from_hf(str(tmp_path / "in"), CPU)
    pretrained.export_hf(model, args, str(tmp_path / "out"), dtype=torch.float32)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                              dtype=torch.float32)
    assert again.model.rotary_emb.attention_scaling == hf.model.rotary_emb.attention_scaling
    assert torch.equal(again.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    ids = batch(seed=5)[0]
    with torch.no_grad():
        assert rel_err(again(ids).logits, hf(ids).logits) < 1e-5


def test_export_bf16_and_load_into_fp32(tmp_path):
    make_hf_model(tmp_path / "in", "llama-llama3")
    model, args = build.build_from_hf(str(tmp_path / "in"), CPU)
    pretrained.export_hf(model, args, str(tmp_path / "out"))  # bf16, one shard
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model-00001-of-00001.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    again, _ = build.build_from_hf(str(tmp_path / "out"), CPU)
    assert again.norm.weight.dtype == torch.float32
    torch.testing.assert_close(again.norm.weight, model.norm.weight.bfloat16().float())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert hf.dtype == torch.bfloat16


def test_export_refuses_a_non_empty_folder_and_a_failure_keeps_the_previous(tmp_path,
                                                                               monkeypatch):
    make_hf_model(tmp_path / "in", "llama-tied")
    model, args = build.build_from_hf(str(tmp_path / "in"), CPU)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        pretrained.export_hf(model, args, str(out))
    assert os.listdir(out) == ["notes.txt"]

    pretrained.export_hf(model, args, str(out), overwrite=True)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    assert "notes.txt" not in before  # replaced as a whole

    import safetensors.torch

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="disk full"):
        pretrained.export_hf(model, args, str(out), overwrite=True)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["in", "out"]  # no temp folder left behind


# ---------------------------------------------------------------------------------------------
# Refusals: a clear ValueError naming the problem, before anything is loaded
# ---------------------------------------------------------------------------------------------

def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,match", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_experts": 8}, "num_experts"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_configs_are_refused(tmp_path, changes, match):
    make_hf_model(tmp_path, "llama-llama3")
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        pretrained.model_args_from_hf(str(tmp_path))


def test_sliding_window_in_use_is_refused(tmp_path):
    make_hf_model(tmp_path, "qwen3-qknorm")
    assert pretrained.model_args_from_hf(str(tmp_path)).qk_norm  # off: accepted
    edit_config(tmp_path, use_sliding_window=True, sliding_window=16)
    with pytest.raises(ValueError, match="use_sliding_window"):
        pretrained.model_args_from_hf(str(tmp_path))
    edit_config(tmp_path, use_sliding_window=False,
                layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        pretrained.model_args_from_hf(str(tmp_path))


def rewrite_weights(path, edit):
    """Re-save model.safetensors with `edit(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("problem", ["no config", "no weights", "index names a missing file",
                                     "missing tensor", "unexpected tensor", "shape mismatch"])
def test_bad_checkpoints_are_refused_before_loading(tmp_path, problem):
    make_hf_model(tmp_path, "llama-llama3")
    model, args = build.build_from_hf(str(tmp_path), CPU)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    before = snapshot(model)
    if problem == "no config":
        os.remove(tmp_path / "config.json")
        match = "no config.json"
    elif problem == "no weights":
        os.remove(tmp_path / "model.safetensors")
        match = r"no \*.safetensors"
    elif problem == "index names a missing file":
        (tmp_path / pretrained.INDEX_NAME).write_text(json.dumps(
            {"weight_map": {"model.norm.weight": "model.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}))
        match = "model-00002-of-00002.safetensors"
    elif problem == "missing tensor":
        rewrite_weights(tmp_path, lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"),
                                             t.pop("lm_head.weight")))
        match = r"missing tensors \['lm_head.weight', 'model.layers.1.mlp.up_proj.weight'\]"
    elif problem == "unexpected tensor":
        rewrite_weights(tmp_path, lambda t: t.update(
            {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
        match = r"unexpected tensors \['model.layers.0.self_attn.q_proj.bias'\]"
    else:
        rewrite_weights(tmp_path, lambda t: t.update(
            {"model.layers.0.mlp.gate_proj.weight": torch.zeros(97, 64)}))
        match = r"model.layers.0.mlp.gate_proj.weight: checkpoint \[97, 64\], model \[96, 64\]"
    with pytest.raises(ValueError, match=match):
        pretrained.load_hf_weights(model, str(tmp_path))
    after = snapshot(model)
    assert all(torch.equal(after[n], before[n]) for n in before)  # nothing was loaded
    if problem != "no config":
        with pytest.raises(ValueError, match=match):
            build.build_from_hf(str(tmp_path), CPU)


def test_tied_checkpoint_with_an_lm_head_copy_loads(tmp_path):
    """Some tied checkpoints store lm_head.weight too: it is the embedding, not an extra."""
    make_hf_model(tmp_path, "llama-tied")
    rewrite_weights(tmp_path, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model, _ = build.build_from_hf(str(tmp_path), CPU)
    assert model.lm_head.weight is model.embed_tokens.weight


# ---------------------------------------------------------------------------------------------
# Sharded: FSDP2 over 2 gloo ranks, each reading its slices
# ---------------------------------------------------------------------------------------------

class ByteCounter:
    """Wraps safetensors.safe_open and counts the tensor bytes handed out (slices or whole)."""
    bytes_read = 0

    def __init__(self, real):
        self.real = real

    def __call__(self, *args, **kwargs):
        handle = self.real(*args, **kwargs)

        class Slice:
            def __init__(self, s):
                self.s = s

            def get_shape(self):
                return self.s.get_shape()

            def get_dtype(self):
                return self.s.get_dtype()

            def __getitem__(self, index):
                out = self.s[index]
                ByteCounter.bytes_read += out.numel() * out.element_size()
                return out

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def metadata(self):
                return handle.metadata()

            def get_slice(self, name):
                return Slice(handle.get_slice(name))

            def get_tensor(self, name):
                out = handle.get_tensor(name)
                ByteCounter.bytes_read += out.numel() * out.element_size()
                return out

        return Handle()


def _sharded_load_matches_single_process(path, use_dcp, world_size):
    assert dist.get_world_size() == world_size
    import safetensors
    from torch.distributed.device_mesh import init_device_mesh

    ids, pos, _, labels = batch(rows=6)
    reference, args = build.build_from_hf(path, CPU)  # no mesh: one process's model
    ref_loss = reference(ids, pos, labels)
    ref_loss.backward()
    total = sum(p.numel() * 4 for p in reference.parameters())

    safetensors.safe_open = ByteCounter(safetensors.safe_open)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ByteCounter.bytes_read = 0
    model, _ = build.build_from_hf(path, CPU, mesh, use_dcp=use_dcp)
    mine = ByteCounter.bytes_read
    if args.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    # Each rank read its half of the weights, not all of them (with all of them: 1.0).
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine)
    assert sum(counts) == total, (counts, total)
    assert max(counts) < 0.6 * total, (counts, total)

    # Data parallel: each rank its rows; FSDP sums the gradients, the loss sums add up.
    mine = slice(dist.get_rank(), len(ids), dist.get_world_size())
    loss = model(ids[mine], pos[mine], labels[mine])
    loss.backward()
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)
    assert total_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(param.grad.full_tensor(), ref.grad) < 1e-5, name
    # A step on the tied weight under FSDP: still one matrix, still equal.
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    with torch.no_grad():
        assert rel_err(model(ids, pos), reference(ids, pos)) < 1e-5


@pytest.mark.parametrize("case,use_dcp,world_size,files", [
    ("llama-llama3", True, 2, "one"),
    pytest.param("qwen3-tied-yarn", True, 2, "several", marks=pytest.mark.slow),
    pytest.param("llama-tied", False, 2, "several", marks=pytest.mark.slow),
    pytest.param("qwen3-tied-yarn", True, 3, "one", marks=pytest.mark.slow),  # uneven shards
    pytest.param("llama-llama3", False, 3, "one", marks=pytest.mark.slow),
])
def test_sharded_load_reads_only_its_slices(tmp_path, case, use_dcp, world_size, files):
    hf = make_hf_model(tmp_path, case)
    if files == "several":  # transformers' own sharded layout: index + model-0000i-of-0000N
        os.remove(tmp_path / "model.safetensors")
        hf.save_pretrained(tmp_path, max_shard_size="40KB")
        assert (tmp_path / pretrained.INDEX_NAME).exists()
        assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    run_ranks(world_size, _sharded_load_matches_single_process, str(tmp_path), use_dcp,
              world_size)


def _sharded_export_equals_single_process(path, out, want):
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, args = build.build_from_hf(path, CPU, mesh)
    pretrained.export_hf(model, args, out, dtype=torch.float32)
    dist.barrier()
    got = {}
    for file in os.listdir(out):
        if file.endswith(".safetensors"):
            got.update(load_file(os.path.join(out, file)))
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_sharded_export_writes_whole_tensors(tmp_path):
    from safetensors.torch import load_file

    make_hf_model(tmp_path / "in", "qwen3-tied-yarn")
    want = load_file(str(tmp_path / "in" / "model.safetensors"))
    run_ranks(2, _sharded_export_equals_single_process, str(tmp_path / "in"),
              str(tmp_path / "out"), want)


# ---------------------------------------------------------------------------------------------
# Through train.py: --init-from under every technique, --export-hf, and back
# ---------------------------------------------------------------------------------------------

def _stack5_equals_single_process(path):
    from reference import assert_matches, make_batch, train_loss_and_grads

    tokens, labels = make_batch(256, 1, 64, ignore_frac=0.1)
    ref_loss, ref_grads = train_loss_and_grads(Config(init_from=path, seq_len=64), tokens,
                                               labels, rt=Runtime())
    loss, grads = train_loss_and_grads(Config(init_from=path, seq_len=64, stack=5,
                                              head_chunk=dist.get_world_size()),
                                       tokens, labels)
    assert_matches(loss, grads, ref_loss, ref_grads, rtol=1e-5, atol=1e-6,
                   what=f"--init-from --stack 5 at P={dist.get_world_size()}")


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_init_from_under_stack_5_equals_the_single_process_model(tmp_path, world_size):
    make_hf_model(tmp_path, "llama-yarn")
    run_ranks(world_size, _stack5_equals_single_process, str(tmp_path))


def test_train_exports_and_init_from_the_export_continues_exactly(tmp_path):
    """train.py --init-from A --export-hf B: transformers loads B with our logits, and
    --init-from B starts where the run ended (the same loss on the next batch)."""
    import train

    make_hf_model(tmp_path / "a", "qwen3-tied-yarn")
    common = dict(seq_len=SEQ, data="synthetic", lr=1e-3)
    run = train.train(Config(init_from=str(tmp_path / "a"), steps=3,
                             export_hf=str(tmp_path / "b"), **common))
    ids, pos, _, labels = batch()
    with torch.no_grad():
        ours = run.model(ids, pos)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "b").float()(ids).logits
    assert rel_err(theirs, ours) < 1e-5
    again = train.train(Config(init_from=str(tmp_path / "b"), steps=0, **common))
    with torch.no_grad():
        assert torch.equal(again.model(ids, pos, labels), run.model(ids, pos, labels))
    # the rotary settings the run trained with travel in config.json
    assert again.model.args == run.model.args
    with pytest.raises(ValueError, match="not empty"):  # refused before any training
        train.parse_args(["--init-from", str(tmp_path / "a"), "--export-hf", str(tmp_path / "b")])


def test_overwrite_export_replaces_a_non_empty_folder_with_the_run(tmp_path):
    """--export-hf into a folder that is not empty: refused before training, naming
    --overwrite-export; with it, the folder is replaced as a whole by this run's weights."""
    import train

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    flags = ["--model", "tiny", "--seq-len", "32", "--steps", "2", "--export-hf", str(out)]
    with pytest.raises(ValueError, match="--overwrite-export to replace it"):
        train.parse_args(flags)
    assert os.listdir(out) == ["notes.txt"]
    run = train.train(train.parse_args(flags + ["--overwrite-export"]))
    assert "notes.txt" not in os.listdir(out) and "config.json" in os.listdir(out)
    exported, _ = build.build_from_hf(str(out), CPU)
    for (name, want), got in zip(run.model.named_parameters(), exported.parameters()):
        assert torch.equal(got, want.detach()), name  # an fp32 run exports fp32: exact


def test_the_printed_continue_command_of_an_exporting_run_runs(tmp_path, capsys):
    """A run with --save-dir and --export-hf prints how to continue it; that command (with a
    larger --steps) runs, and replaces the run's export with the continued run's. It once
    stopped at the start: the export folder, this run's own, was not empty."""
    import shlex

    import train
    from support import saved_state

    argv = ["train.py", "--seq-len", "32", "--steps", "2", "--save-dir", str(tmp_path / "saves"),
            "--export-hf", str(tmp_path / "out")]
    train.main(argv[1:])
    command = shlex.split(saved_state.resume_command(argv))
    assert command[-2:] == ["--overwrite-export", "--resume"], command
    assert command.count("--overwrite-export") == 1 and saved_state.resume_command(
        command[1:]).count("--overwrite-export") == 1  # added once
    flags = command[2:]  # past `python train.py`
    flags[flags.index("--steps") + 1] = "3"  # one step more than the run saved
    continued = train.train(train.parse_args(flags))
    assert "resumed at step 2" in capsys.readouterr().out
    exported, _ = build.build_from_hf(str(tmp_path / "out"), CPU)
    for (name, want), got in zip(continued.model.named_parameters(), exported.parameters()):
        assert torch.equal(got, want.detach()), name  # the continued run's weights


# ---------------------------------------------------------------------------------------------
# An export others can use: written where it can be, readable, with its tokenizer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["under_a_file", "proc"])
@pytest.mark.slow
def test_export_that_can_never_be_written_is_refused_before_training(tmp_path, where):
    (tmp_path / "a_file").write_text("x")
    out = str(tmp_path / "a_file" / "export") if where == "under_a_file" else "/proc/no/export"
    with pytest.raises(ValueError, match="export: .* cannot be"):
        pretrained.check_export_dir(out)
    done = subprocess.run([sys.executable, "train.py", "--export-hf", out, "--steps", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "step" not in done.stdout  # refused before the first step
    assert done.stderr.startswith("error: export:") and "Traceback" not in done.stderr


def test_export_has_the_umask_permissions(tmp_path):
    make_hf_model(tmp_path / "in", "llama-tied")
    model, args = build.build_from_hf(str(tmp_path / "in"), CPU)
    old = os.umask(0o022)
    try:
        pretrained.export_hf(model, args, str(tmp_path / "out"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o755
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "out").iterdir()} == {0o644}


@pytest.mark.parametrize("scaling", ["yarn", "llama3"])
def test_scaled_rotary_export_loads_without_a_rope_warning(tmp_path, caplog, scaling):
    """A run no longer than the original context (train.py passes max(--seq-len, original)):
    config.json's max_position_embeddings is original x factor, which transformers checks
    (yarn reads its factor against it; llama3 warns where the original is not below it)."""
    args = replace(llama.get_model_args("tiny"), rope_scaling=scaling, rope_factor=4.0,
                   rope_original_context=64)
    model = llama.Transformer(args)
    pretrained.export_hf(model, args, str(tmp_path / "out"), max_position_embeddings=64)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["max_position_embeddings"] == 256  # original x factor: what transformers checks
    transformers.utils.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    finally:
        transformers.utils.logging.disable_propagation()
    assert not [r for r in caplog.records if "rope" in r.getMessage().lower()
                or "max_position_embeddings" in r.getMessage()]


@pytest.mark.slow
def test_export_after_prepared_data_carries_its_tokenizer(tmp_path):
    """Trained on prepare_data.py's output, the export holds the tokenizer and its end-of-text
    id: AutoTokenizer and generate work from the export folder alone."""
    from test_packed import _local_tokenizer

    prepare_data = importlib.import_module("prepare_data")
    tokenizer_dir = _local_tokenizer(tmp_path / "tok")
    (tmp_path / "docs.txt").write_text("the cat sat on the mat\na dog ran far away\n" * 20)
    data = str(tmp_path / "train.bin")
    info = prepare_data.prepare(tokenizer_dir, [str(tmp_path / "docs.txt")], data, txt_lines=True,
                                progress=False)
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "train.py", "--data", data, "--documents", "--seq-len",
                           "16", "--steps", "2", "--export-hf", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == info["separator_id"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.eos_token_id == info["separator_id"]
    ids = tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    from tokenizers import Tokenizer
    assert ids == Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).encode(
        "the cat sat", add_special_tokens=False).ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    generated = hf.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert (generated.shape[1] <= len(ids) + 3
            and hf.generation_config.eos_token_id == info["separator_id"])


@pytest.mark.slow
def test_an_export_that_fails_at_the_end_is_a_clear_error_not_a_traceback(tmp_path):
    """Should the export fail after training all the same (a full disk), train.py ends with one
    `error:` line naming it (nothing replaced), not a traceback."""
    code = ("import sys, safetensors.torch, train\n"
            "def full(*a, **k): raise OSError(28, 'No space left on device')\n"
            "safetensors.torch.save_file = full\n"
            f"train.main(['--steps', '1', '--export-hf', {str(tmp_path / 'out')!r}])\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "error: export to" in done.stderr and "No space left" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["header cut", "data cut", "config.json"])
def test_damaged_weights_are_refused_before_overwrite_clears_the_outputs(tmp_path, damage,
                                                                        capsys):
    """An --init-from folder whose safetensors file is cut short (an interrupted download) or
    whose config.json is not JSON: a clear error naming the file before --overwrite deletes the
    earlier run's saves and log; the same folder whole trains."""
    import train

    folder = tmp_path / "hf"
    make_hf_model(folder)
    saves, log = tmp_path / "ck", tmp_path / "log.jsonl"
    outputs = ["--save-dir", str(saves), "--log-file", str(log), "--seq-len", "32"]
    train.main(["--init-from", str(folder), "--steps", "1", *outputs])
    kept = {p: p.stat().st_mtime_ns for p in [log, *saves.rglob("*")]}
    weights = next(folder.glob("*.safetensors"))
    data = weights.read_bytes()
    if damage == "config.json":
        (folder / "config.json").write_text("{architectures: oops")
    else:
        weights.write_bytes(data[:1000] if damage == "header cut" else data[:-100])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(["--init-from", str(folder), "--steps", "1", "--overwrite", *outputs])
    err = capsys.readouterr().err
    named = "config.json" if damage == "config.json" else weights.name
    assert named in err and ("cut short" in err or "not" in err) and "Traceback" not in err, err
    assert {p: p.stat().st_mtime_ns for p in [log, *saves.rglob("*")]} == kept
