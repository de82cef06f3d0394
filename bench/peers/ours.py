"""ours: train.py's own recipe, one process, through train.py's functions.

`--stack N` as train.py reads it (support.config.resolve_techniques), the attention kernel of
--attn-kernel (the spec's @KERNEL; default auto: FlashAttention-4 where installed, else cuDNN),
keep-attention, Untied Ulysses' head chunk and 04's MLP tile decided per length as train.py
decides them (plan.plan_run: the planner, on a GPU), the model built by
train.build_model (fp32 master weights, bf16 compute through FSDP2's mixed precision; a group of
one process), train.make_optimizer (fused AdamW, fp32 state; with +offload on the host),
and train.train_step (forward, backward, clipping at 1.0, the optimizer step).

The run's Config is made by train.py's own flag parser from the flags a user would give
(`train_flags`), again at every length, as a new run would: `ours:auto` passes `--stack auto`
through as that string (train.py's speed-model choice, plan.plan_run). A new model is built
whenever the length changes what the run is (techniques, keep-attention, head chunk, MLP tile).
"""

import contextlib
import dataclasses
import importlib
import io
import time

import torch

import plan
from bench import bound
from bench.peers.common import GRAD_CLIP, WEIGHT_DECAY, Spec
from bench.report import release
from support.config import model_args, techniques_text
from support.runtime import read_machine, setup_runtime
from support.progress import attention_kernel

train = importlib.import_module("train")


def train_flags(spec: Spec, model: str, device: torch.device, init_from: str | None,
                lr: float | None, seed: int, seq_len: int) -> list:
    """train.py's command line for this stack at `seq_len` (steps: enough for any row)."""
    flags = ["--init-from", init_from] if init_from else ["--model", model]
    flags += ["--stack", str(spec.level), "--attn-kernel", spec.variant, "--seq-len", str(seq_len),
              "--device", device.type, "--dtype", "bfloat16" if device.type == "cuda"
              else "float32", "--seed", str(seed), "--steps", "1000",
              "--weight-decay", str(WEIGHT_DECAY), "--grad-clip", str(GRAD_CLIP)]
    flags += ["--lr", str(lr)] if lr is not None else []
    return (flags + (["--offload-model-state"] if spec.offload else [])
            + ([] if spec.overlap_optimizer is None else
               ["--overlap-optimizer" if spec.overlap_optimizer else "--no-overlap-optimizer"])
            + (["--offload-moments"] if spec.offload_moments else []))


def run_config(flags: list, spec: Spec):
    """train.py's Config of `flags` (its parser and technique resolution), or ValueError."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return train.parse_args(flags)
    except SystemExit:
        message = (errors.getvalue().strip().splitlines() or ["train.py refused the flags"])[-1]
        raise ValueError(f"{spec.text}: {message}") from None


class Stack:
    def __init__(self, spec: Spec, model: str, device: torch.device, init_from: str | None,
                 lr: float | None, seed: int):
        self.flags = lambda seq_len: train_flags(spec, model, device, init_from, lr, seed,
                                                 seq_len)
        self.spec = spec
        self.cfg = run_config(self.flags(256), spec)  # refuses bad flags before any row
        self.rt = setup_runtime(self.cfg)
        self.args = model_args(self.cfg)
        self.vocab_size = self.args.vocab_size
        self.model = self.optimizer = None
        self.built_for = None  # the Config (less the length) of the model in hand
        self.step_index = 0
        self.build_s = None

    def prepare(self, seq_len: int) -> None:
        """train.py's per-run decisions at this length; a new model when they change."""
        cfg = run_config(self.flags(seq_len), self.spec)
        cfg = dataclasses.replace(cfg, **plan.plan_run(cfg, read_machine(cfg)).settings)
        # --stack auto's techniques may change with the length: the runtime follows them
        self.cfg, self.rt = cfg, setup_runtime(cfg)
        decisions = dataclasses.replace(cfg, seq_len=0)
        if decisions == self.built_for:
            return
        self.model = self.optimizer = None
        release(self.rt.device)
        started = time.perf_counter()
        self.model = train.build_model(cfg, self.rt)
        self.optimizer = train.make_optimizer(self.model, cfg)
        self.build_s = time.perf_counter() - started
        self.built_for = decisions

    def step(self, tokens: torch.Tensor) -> dict:
        metrics = train.train_step(self.model, self.optimizer, tokens, self.rt, self.cfg,
                                   step=self.step_index)
        self.step_index += 1
        # The row records train.py's per-length decisions with it (stack_info has the last).
        return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                "keep_attention": self.cfg.keep_attention, "head_chunk": self.cfg.head_chunk,
                "mlp_tile_tokens": self.cfg.mlp_tile_tokens,
                "techniques": techniques_text(self.cfg, self.cfg.head_chunk, self.rt.ring),
                "config": dataclasses.asdict(self.cfg), "loss_tiles": bound.LOSS_TILES}

    def about(self) -> dict:
        cfg = self.cfg
        return {
            "stack": f"train.py --stack {self.spec.level}" + (" --offload-model-state"
                                                              if cfg.offload_model_state else ""),
            "techniques": techniques_text(cfg, cfg.head_chunk, self.rt.ring),
            "keep_attention": cfg.keep_attention, "mlp_tile_tokens": cfg.mlp_tile_tokens,
            "keep_attention_source": "plan.plan_run (train.py's default, from the planner)",
            "attention": attention_kernel(cfg, self.rt, self.args),
            "weights": "fp32 master, bf16 compute (FSDP2 mixed precision)"
                       if cfg.dtype == "bfloat16" else cfg.dtype,
            "optimizer": "torch AdamW fused, fp32 state on the "
                         + ("host" if cfg.offload_model_state else "GPU")
                         + (", each unit's update beside its next forward (08)"
                            if cfg.overlap_optimizer else "")
                         + (", the blocks' moments streamed from the host (09)"
                            if cfg.offload_moments else ""),
            "lr": cfg.lr, "build_s": self.build_s,
        }
