"""What the three stacks share: a stack's spec, the step's inputs, the optimizer settings."""

import re
from dataclasses import dataclass

import torch

# Every stack steps with these AdamW settings (train.py's), so that the loss check's second step
# compares the same update; the recipe's own (ArcticTraining: betas 0.9/0.999, weight decay 0.1)
# change no step time.
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.0
GRAD_CLIP = 1.0

SPEC = re.compile(r"^(?P<name>ours|alst|hf)(:(?P<level>\d+))?(@(?P<variant>[\w.-]+))?"
                  r"(?P<offload>\+offload)?$")
VARIANTS = {"ours": ("auto", "fa4", "cudnn", "flash", "math"),  # --attn-kernel
            # alst's loss: Liger's fused linear CE, or DeepSpeed's tiled one; @sdpa: Liger, sdpa
            "alst": ("liger", "tiledloss", "sdpa"),
            "hf": ("bf16", "fp32")}  # the weights and AdamW state: bf16, or fp32 + autocast


@dataclass(frozen=True)
class Spec:
    """A stack as the command line names it: ours:5, ours:5@cudnn, ours:5+offload, alst,
    alst@tiledloss, alst+offload, hf, hf@fp32."""
    text: str
    name: str
    level: int | None
    variant: str
    offload: bool  # model state in host memory (ours: --offload-model-state; alst: ZeRO offload)


def parse_spec(text: str) -> Spec:
    match = SPEC.match(text)
    if not match:
        raise ValueError(f"stack {text!r}: expected ours:N[@KERNEL][+offload], "
                         f"alst[@liger|@tiledloss|@sdpa][+offload] or hf[@bf16|@fp32]")
    name, level, variant = match["name"], match["level"], match["variant"]
    if (name == "ours") != (level is not None):
        raise ValueError(f"stack {text!r}: ours takes a --stack level (ours:4, ours:5), "
                         f"alst and hf take none")
    variant = variant or VARIANTS[name][0]
    if variant not in VARIANTS[name]:
        raise ValueError(f"stack {text!r}: {name}'s variants are {', '.join(VARIANTS[name])}")
    if name == "hf" and match["offload"]:
        raise ValueError(f"stack {text!r}: transformers alone keeps its model state on the GPU")
    return Spec(text, name, None if level is None else int(level), variant, bool(match["offload"]))


def step_inputs(tokens: torch.Tensor, device) -> tuple:
    """(input_ids, labels, position_ids) of a window (1, S + 1): the S tokens, the S next
    tokens (already shifted, as ALST's shift_labels), positions 0..S-1; as train.py's step."""
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1] - 1, device=device)[None].expand(tokens.shape[0], -1)
    return tokens[:, :-1], tokens[:, 1:], positions


def window(vocab_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """The tokens of a length: the same (1, S + 1) random ids for every stack."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + seq_len)
    return torch.randint(0, vocab_size, (1, seq_len + 1), generator=generator)

