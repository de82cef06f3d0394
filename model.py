"""A compact Llama-3 (and Qwen3-shaped) transformer that knows nothing of distribution.

The numbered files plug into its seams, attributes replaced from outside without editing this file:

  1. `Attention.core(q, k, v, cu_seqlens)`   the kernel over local tensors (B, S, heads, D):
                                             torch's SDPA here (`sdpa_attention`); the build
                                             (support/build.py) puts base/kernels.py's in its
                                             place. 02_ulysses.py wraps it in two all-to-alls.
  2. `Attention.attend(x, rope, cu_seqlens)` normed input (B, S, dim) -> pre-`o_proj` output
                                             (B, S, heads * D). 05_untied_ulysses.py replaces
                                             it: it projects Q/K/V one head chunk at a time.
  3. `MLP.forward(x)`                        04_alst_tiling.py runs it tile by tile; the build
                                             puts base/fused.py's in its place (SwiGLU and
                                             down_proj in one autograd step, keeping less).
  4. `RMSNorm.forward(x)`                    04 (--tile-norm) tiles each block's norms: where
                                             they run op by op (off CUDA) their fp32 copies span
                                             the sequence; on CUDA F.rms_norm is one fused
                                             kernel and --stack leaves them untiled.
  5. `Transformer.loss_sum(h, labels)`       final norm + lm_head + cross-entropy summed over
                                             tokens; 04 tiles it so seq x vocab logits never exist.
     `Transformer.token_scores(h, labels)`  its per-token sibling (each token's loss and greedy
                                             prediction), which eval.py tiles the same way.
  6. `Attention.rotary`,                    the elementwise work, `apply_rope`,
     `Transformer.cross_entropy`,            `cross_entropy_sum` and `logit_scores` here; the
     `Transformer.logit_scores`              build puts base/fused.py's forms in their place
                                             (fused GPU kernels each way; the logits stay bf16).

Positions are global token indices passed in with the ids, so a sequence shard gets the right
rotary phases without any gather. Packed documents (support/data.py): positions restart at 0 at
each document, labels are IGNORE_INDEX at each document's last token, and `cu_seqlens` (the
whole batch's document boundaries as global token offsets, `sdpa_attention`) goes to the two
attention seams, where the kernel masks; norms, MLP and loss are per token.

Weight names and layouts are those of Hugging Face Llama/Qwen3 checkpoints without the leading
"model." (`layers.0.self_attn.q_proj.weight`, ...): Q/K/V rows in the standard head order (head
h owns rows h*D..(h+1)*D), rotate-half rotary, so a converted state dict loads as it is, with or
without any technique applied.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # label value that contributes nothing to the loss


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_dim: int = 14336
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    # Rotary, with Hugging Face's meaning of each field (rope_parameters in a config.json):
    rope_theta: float = 500000.0
    rope_scaling: str = "llama3"  # "none", "llama3" (Llama-3.1 long context) or "yarn"
    rope_factor: float = 8.0  # llama3, yarn: how much the long wavelengths are stretched
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original/low are stretched
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept
    rope_original_context: int = 8192  # llama3, yarn: the context length of pretraining
    rope_beta_fast: float = 32.0  # yarn: rotations per original context above which a
    rope_beta_slow: float = 1.0  # yarn:   frequency is kept, and below which it is stretched
    # yarn: multiplies cos and sin; None: 0.1 ln(factor) + 1
    rope_attention_factor: float | None = None
    rope_truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    tie_word_embeddings: bool = False  # lm_head.weight is embed_tokens.weight (one Parameter)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before rotary
    eos_id: int | None = None  # end-of-document token: the default separator of packed documents


PRESETS = {
    # For tests: 8 query heads and 2 KV heads, so GQA with fewer KV heads than ranks (P=4) is hit.
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8, ffn_dim=128,
                      vocab_size=256, rope_theta=10000.0),
    # A small demo model that trains in seconds on a CPU.
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768,
                       vocab_size=4096),
    # The published configs (Hugging Face config.json) of each model.
    "llama3.2-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                             ffn_dim=8192, rope_factor=32.0, tie_word_embeddings=True,
                             eos_id=128001),
    "llama3.2-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
                             ffn_dim=8192, rope_factor=32.0, tie_word_embeddings=True,
                             eos_id=128001),
    # Llama-3.1's rope scaling (factor 8, 128K context), as Llama-3.1-8B's config.json has;
    # Meta-Llama-3-8B's own has none (8K context): --rope-scaling none trains it.
    "llama3-8b": ModelArgs(eos_id=128001),  # <|end_of_text|> of the base models
    "qwen3-0.6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                            ffn_dim=3072, vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0,
                            rope_scaling="none", tie_word_embeddings=True, qk_norm=True,
                            eos_id=151643),
    "qwen3-32b": ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                           ffn_dim=25600, vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0,
                           rope_scaling="none", qk_norm=True, eos_id=151643),  # <|endoftext|>
    "llama3-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                            ffn_dim=28672, eos_id=128001),
}


def get_model_args(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


# ---- Rotary embeddings (Hugging Face's default, llama3 and yarn types), by global position ----

ROPE_SCALINGS = ("none", "llama3", "yarn")


def rope_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in fp32, with the long-context scaling of `args`.

    Both scalings slow down (divide by `rope_factor`) the low frequencies, whose wavelengths are
    longer than the pretraining context, keep the high ones, and blend the band in between.
    """
    theta_powers = args.rope_theta ** (torch.arange(0, args.head_dim, 2, device=device,
                                                    dtype=torch.float32) / args.head_dim)
    inv_freq = 1.0 / theta_powers  # theta^(-2i/d): each pair of dimensions' angle per position
    if args.rope_scaling == "none":
        return inv_freq
    if args.rope_scaling == "llama3":  # the band is chosen by wavelength
        wavelen = 2 * math.pi / inv_freq
        smooth = ((args.rope_original_context / wavelen - args.rope_low_freq_factor)
                  / (args.rope_high_freq_factor - args.rope_low_freq_factor)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / args.rope_factor + smooth * inv_freq
    if args.rope_scaling == "yarn":  # the band is chosen by dimension index, a linear ramp
        low, high = yarn_ramp_ends(args)
        if low == high:
            high += 0.001  # as transformers does: no division by zero
        ramp = ((torch.arange(args.head_dim // 2, dtype=torch.float32, device=device) - low)
                / (high - low)).clamp(0.0, 1.0)
        keep = 1 - ramp  # 1 for the fast dimensions (below `low`), 0 above `high`
        return 1.0 / (args.rope_factor * theta_powers) * (1 - keep) + inv_freq * keep
    raise ValueError(f"rope_scaling={args.rope_scaling!r}; choose one of {ROPE_SCALINGS}")


def yarn_ramp_ends(args: ModelArgs) -> tuple[float, float]:
    """The dimensions where a frequency turns beta_fast and beta_slow rotations over the original
    context: below the first it is kept, above the second stretched (transformers' formula)."""
    def dim_of(rotations):
        return (args.head_dim * math.log(args.rope_original_context / (rotations * 2 * math.pi))
                / (2 * math.log(args.rope_theta)))

    low, high = dim_of(args.rope_beta_fast), dim_of(args.rope_beta_slow)
    if args.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, args.head_dim - 1)


def rope_attention_factor(args: ModelArgs) -> float:
    """What cos and sin are multiplied by: yarn sharpens attention a little as it stretches."""
    if args.rope_scaling != "yarn":
        return 1.0
    if args.rope_attention_factor is not None:
        return args.rope_attention_factor
    return 1.0 if args.rope_factor <= 1 else 0.1 * math.log(args.rope_factor) + 1.0


def rope_cos_sin(position_ids: torch.Tensor, args: ModelArgs, dtype: torch.dtype):
    """cos and sin of shape (B, S, head_dim // 2) for global positions (B, S).

    Angles are computed in fp32 (positions up to 16M are exact there) and stored in the compute
    dtype: half a head's width, not a full one, since both halves share the same angle.
    """
    inv_freq = rope_frequencies(args, position_ids.device)
    angles = position_ids[..., None].float() * inv_freq
    cos, sin = angles.cos(), angles.sin()
    scale = rope_attention_factor(args)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x (B, S, heads, D) with cos/sin (B, S, D // 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---- Layers -----------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, the statistics in fp32 (as Llama does), output in x's dtype. On CUDA
    F.rms_norm is one fused kernel that keeps only x and 1/rms for backward; op by op (as it
    runs elsewhere) it keeps fp32 copies of x (bench/rms_norm.py compares the two)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens=None) -> torch.Tensor:
    """Seam 1 as this file runs it: causal softmax(q k^T / sqrt(D)) v by torch's SDPA, q (B, S, H,
    D), k and v (B, S, Hkv, D), query head h using KV head h // (H // Hkv). cu_seqlens: packed
    documents, (0, ..., B*S), the boundaries of the B*S tokens taken as one stream (every row
    start among them; FlashAttention's convention): each document attends only to itself."""
    if cu_seqlens is not None:
        lengths = [end - start for start, end in zip(cu_seqlens, cu_seqlens[1:])]
        documents = zip(*(t.flatten(0, 1)[None].split(lengths, dim=1) for t in (q, k, v)))
        return torch.cat([sdpa_attention(*document) for document in documents], 1).view_as(q)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (B, heads, S, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core = sdpa_attention  # seam 1: (q, k, v, cu_seqlens=None) -> out, local tensors
        self.rotary = apply_rope  # seam 6: (x, cos, sin) -> x rotated

    def forward(self, x: torch.Tensor, rope, cu_seqlens=None) -> torch.Tensor:
        return self.o_proj(self.attend(x, rope, cu_seqlens=cu_seqlens))

    def attend(self, x: torch.Tensor, rope, cu_seqlens=None) -> torch.Tensor:
        """Seam 2: normed input (B, S, dim) -> attention output (B, S, heads * D), before o_proj.
        cu_seqlens: packed documents' global boundaries (None: one document per row)."""
        q, k, v = self.project_qkv(x, rope)
        return self.core(q, k, v, cu_seqlens=cu_seqlens).flatten(2)

    def project_qkv(self, x: torch.Tensor, rope):
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        return self.rotary(q, cos, sin), self.rotary(k, cos, sin), v


def swiglu_act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up."""
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Seam 3 is this module's forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_act(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, rope, cu_seqlens=None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, cu_seqlens)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.cross_entropy = cross_entropy_sum  # seam 6: (logits, labels) -> summed loss
        self.logit_scores = logit_scores  # seam 6: (logits, labels) -> (tokens, 2) scores
        if args.tie_word_embeddings:
            # One Parameter in both places: its gradient sums both uses, FSDP2 shards it once
            # (both are on the root module) and named_parameters() lists it once. A model moved
            # off the meta device gets a new Parameter per module: support/build.py ties again.
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels=None,
                per_token: bool = False, cu_seqlens=None):
        """input_ids, position_ids, labels: (B, S) local tokens with their global positions.
        cu_seqlens: packed documents' boundaries over the whole (unsharded) batch, global token
        offsets (`sdpa_attention`); None: one document per row.

        With labels: the summed cross-entropy over non-ignored labels (divide by the global
        token count to get the mean); with per_token=True instead `token_scores` (B, S, 2).
        Without labels: the logits (B, S, vocab).
        """
        h = self.embed_tokens(input_ids)
        rope = rope_cos_sin(position_ids, self.args, h.dtype)
        for layer in self.layers:
            h = layer(h, rope, cu_seqlens)
        if labels is None:
            return self.lm_head(self.norm(h))
        if per_token:
            return self.token_scores(h, labels)
        return self.loss_sum(h, labels)

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Seam 5: final norm + lm_head + cross-entropy summed over tokens (fp32 statistics)."""
        return self.cross_entropy(self.lm_head(self.norm(h)).flatten(0, 1), labels.flatten())

    def token_scores(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Seam 5, per token (evaluation): (B, S, 2) fp32, [..., 0] each token's cross-entropy
        (0 where the label is ignored) and [..., 1] its greedy prediction, the argmax token id
        (exact in fp32 below 2^24 ids). Untiled, like loss_sum: eval.py tiles it."""
        return token_scores(h, labels, self.norm.weight, self.lm_head.weight, eps=self.norm.eps,
                            logit_scores=self.logit_scores)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of (tokens, vocab) logits in fp32, summed over the tokens whose label
    counts (not IGNORE_INDEX)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def logit_scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(tokens, 2) fp32 from (tokens, vocab) logits: each row's cross-entropy (0 where the label
    is IGNORE_INDEX) and its argmax token id (exact in fp32 below 2^24 ids)."""
    logits = logits.float()
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    return torch.stack((losses, logits.argmax(-1).float()), dim=-1)


def token_scores(h, labels, norm_weight, lm_head_weight, *, eps: float,
                 logit_scores=logit_scores) -> torch.Tensor:
    """Transformer.token_scores with its weights (and its logit_scores seam) as arguments, for
    any leading shape of h."""
    logits = F.linear(rms_norm(h, norm_weight, eps), lm_head_weight)
    return logit_scores(logits.flatten(0, -2), labels.flatten()).view(*labels.shape, 2)


INIT_STD = 0.02  # the weights' initial standard deviation (norms start at 1)


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0, exact: bool = True) -> None:
    """Random init (normal 0.02, norms at 1), from `seed`.

    exact=True: parameter after parameter from one seeded CPU generator, so the values do not
    depend on the device (support/build.py keeps a shard's rows of these same draws).
    exact=False: each parameter from its own stream on its own device (`own_stream`), fast
    enough for the 8B-70B presets, which would take minutes to draw on a CPU; for real
    training load a checkpoint.
    """
    generator = torch.Generator().manual_seed(seed)
    for index, (name, param) in enumerate(model.named_parameters()):
        if is_norm(name):
            param.fill_(1.0)
        elif exact:
            param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
        else:
            param.normal_(0.0, INIT_STD, generator=own_stream(seed, index, param.device))


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def own_stream(seed: int, index: int, device, part: int = 0) -> torch.Generator:
    """Parameter `index`'s own generator on `device`; `part`: which piece of it is drawn, for a
    model held in pieces. A device's default generator starts alike on every device."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index * 1_009 + part)


def num_params(args: ModelArgs) -> int:
    """Parameter count from the shapes alone (no allocation)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    mlp = 3 * args.dim * args.ffn_dim
    norms = 2 * args.dim + (2 * args.head_dim if args.qk_norm else 0)
    embeddings = (1 if args.tie_word_embeddings else 2) * args.vocab_size * args.dim
    return args.n_layers * (attn + mlp + norms) + embeddings + args.dim
