"""ours: train.py's own recipe, one process, through train.py's functions.

`--stack N` as train.py reads it (support.config.resolve_techniques), the attention kernel of
--attn-kernel (the spec's @KERNEL; default auto: FlashAttention-4 where installed, else cuDNN),
keep-attention, Untied Ulysses' head chunk and 04's MLP tile decided per length as train.py
decides them (support/choices.py: the planner, on a GPU), the model built by
train.build_model (fp32 master weights, bf16 compute through FSDP2's mixed precision; a group of
one process), train.make_optimizer (fused AdamW, fp32 state; with +offload on the host),
and train.train_step (forward, backward, clipping at 1.0, the optimizer step).
"""

import importlib
import time

import torch

from bench.peers.common import GRAD_CLIP, WEIGHT_DECAY, Spec
from bench.report import release
from support.choices import choose_for_run
from support.config import Config, techniques_text
from support.host_memory import check_host_memory

train = importlib.import_module("train")


class Stack:
    def __init__(self, spec: Spec, model: str, device: torch.device, init_from: str | None,
                 lr: float | None, seed: int):
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        cfg = Config(model=model, init_from=init_from, stack=spec.level, attn_kernel=spec.variant,
                     offload_model_state=spec.offload, device=device.type, dtype=dtype, seed=seed,
                     steps=1000, lr=lr, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP)
        self.cfg = train.resolve_techniques(cfg)
        self.rt = train.setup_runtime(self.cfg)
        self.args = train.model_args(self.cfg)
        self.vocab_size = self.args.vocab_size
        self.model = self.optimizer = None
        self.built_for = None  # (keep_attention, head_chunk, MLP tile) of the model in hand
        self.step_index = 0
        self.build_s = None

    def prepare(self, seq_len: int) -> None:
        """train.py's per-run decisions at this length; a new model when they change."""
        cfg = self.cfg
        cfg.seq_len = seq_len
        # Decided again at each length, as a new run would.
        cfg.head_chunk = cfg.keep_attention = cfg.mlp_tile_tokens = None
        cfg.head_chunk, cfg.keep_attention, cfg.mlp_tile_tokens = choose_for_run(cfg, self.rt)
        check_host_memory(cfg, self.rt)
        decisions = (cfg.keep_attention, cfg.head_chunk, cfg.mlp_tile_tokens)
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
                "mlp_tile_tokens": self.cfg.mlp_tile_tokens}

    def about(self) -> dict:
        cfg = self.cfg
        return {
            "stack": f"train.py --stack {cfg.stack}" + (" --offload-model-state"
                                                       if cfg.offload_model_state else ""),
            "techniques": techniques_text(cfg, cfg.head_chunk, self.rt.ring),
            "keep_attention": cfg.keep_attention, "mlp_tile_tokens": cfg.mlp_tile_tokens,
            "keep_attention_source": "support/choices.py (train.py's default, from the planner)",
            "attention": train.attention_kernel(cfg, self.rt, self.args),
            "weights": "fp32 master, bf16 compute (FSDP2 mixed precision)"
                       if cfg.dtype == "bfloat16" else cfg.dtype,
            "optimizer": "torch AdamW fused, fp32 state on the "
                         + ("host" if cfg.offload_model_state else "GPU"),
            "lr": cfg.lr, "build_s": self.build_s,
        }
