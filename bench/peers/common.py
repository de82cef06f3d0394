"""What the three stacks share: a stack's spec, the step's inputs, the optimizer settings."""

import re
from dataclasses import dataclass

import torch

from support.config import ADAMW_BETAS, DEFAULTS

# Every stack steps with these AdamW settings (train.py's defaults), so that the loss check's
# second step compares the same update; ALST's recipe's own (ArcticTraining: betas 0.9/0.999,
# weight decay 0.1) change no step time.
BETAS = ADAMW_BETAS
WEIGHT_DECAY = DEFAULTS.weight_decay
GRAD_CLIP = DEFAULTS.grad_clip

SPEC = re.compile(r"^(?P<name>ours|alst|hf)(:(?P<level>\d+|auto))?(@(?P<variant>[\w.-]+))?"
                  r"(?P<offload>\+offload)?(?P<overlap>\+(no)?overlap|\+moments)?"
                  r"(?P<nockpt>\+nockpt)?$")
VARIANTS = {"ours": ("auto", "fa4", "cudnn", "flash", "math"),  # --attn-kernel
            # alst's loss: Liger's fused linear CE, or DeepSpeed's tiled one; @sdpa: Liger, sdpa
            "alst": ("liger", "tiledloss", "sdpa"),
            "hf": ("bf16", "fp32")}  # the weights and AdamW state: bf16, or fp32 + autocast
# Each stack at its best that fits, run.py's default (a choice's alternatives: fastest first)
BEST = {"ours": "ours:auto", "hf": "hf+nockpt|hf", "alst": "alst|alst+offload"}


@dataclass(frozen=True)
class Spec:
    """A stack as the command line names it: ours:5, ours:auto, ours:5@cudnn, ours:5+offload,
    ours:auto+overlap, ours:auto+nooverlap, ours:auto+moments, alst, alst@tiledloss,
    alst+offload, hf, hf@fp32, hf+nockpt."""
    text: str
    name: str
    level: int | str | None  # ours: a --stack level, or "auto"
    variant: str
    offload: bool  # model state in host memory (ours: --offload-model-state; alst: ZeRO offload)
    checkpoint: bool = True  # hf: transformers' gradient checkpointing (+nockpt: without)
    overlap_optimizer: bool | None = None  # ours: +overlap --overlap-optimizer (08), AdamW
    # beside the forward; +nooverlap --no-overlap-optimizer; neither: the plan decides
    offload_moments: bool = False  # ours: +moments --offload-moments (09, with 08)


def parse_spec(text: str) -> Spec:
    match = SPEC.match(text)
    if not match:
        raise ValueError(f"stack {text!r}: expected "
                         f"ours:N|auto[@KERNEL][+offload][+overlap|+nooverlap|+moments], "
                         f"alst[@liger|@tiledloss|@sdpa][+offload] or hf[@bf16|@fp32][+nockpt]")
    name, level, variant = match["name"], match["level"], match["variant"]
    if (name == "ours") != (level is not None):
        raise ValueError(f"stack {text!r}: ours takes a --stack level (ours:4, ours:5, "
                         f"ours:auto), alst and hf take none")
    variant = variant or VARIANTS[name][0]
    if variant not in VARIANTS[name]:
        raise ValueError(f"stack {text!r}: {name}'s variants are {', '.join(VARIANTS[name])}")
    if name == "hf" and match["offload"]:
        raise ValueError(f"stack {text!r}: transformers alone keeps its model state on the GPU")
    if name != "hf" and match["nockpt"]:
        raise ValueError(f"stack {text!r}: +nockpt is transformers' (ours decides per length, "
                         f"ALST's recipe always checkpoints)")
    if name != "ours" and match["overlap"]:
        raise ValueError(f"stack {text!r}: {match['overlap']} is ours' (--overlap-optimizer, 08; "
                         f"--offload-moments, 09)")
    level = level if level in (None, "auto") else int(level)
    moments = match["overlap"] == "+moments"
    overlap = None if not match["overlap"] else match["overlap"] in ("+overlap", "+moments")
    return Spec(text, name, level, variant, bool(match["offload"]), not match["nockpt"], overlap,
                moments)


def parse_choice(text: str) -> list:
    """A stack, or a choice of stacks 'A|B|...' tried in that order at each length (fastest
    first): the first that does not run out of memory is the stack's best there."""
    specs = [parse_spec(part) for part in text.split("|")]
    if len({spec.name for spec in specs}) > 1:
        raise ValueError(f"stack {text!r}: a choice is among configurations of one stack")
    if len({spec.text for spec in specs}) < len(specs):
        raise ValueError(f"stack {text!r}: an alternative appears twice")
    return specs


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

