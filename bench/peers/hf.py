"""hf: transformers alone. LlamaForCausalLM from a LlamaConfig equal to our preset
(support/pretrained.hf_config: the same shapes, llama3 rotary scaling, tied embeddings where the
preset ties them), attn_implementation="sdpa", gradient checkpointing (transformers' default:
torch's non-reentrant checkpoint around each decoder layer; hf+nockpt: none, every layer's
activations kept, ~1.3x faster where it fits), torch's fused AdamW (the Trainer's
default optimizer), the model's own loss function on its full logits (no tiling).

Weights and optimizer state, the spec's variant:
  hf       bf16 weights, bf16 gradients, bf16 AdamW moments (8 bytes a parameter): the least
           memory transformers alone trains in, a little less exact than fp32 master weights.
  hf@fp32  fp32 weights and AdamW moments, bf16 compute under torch.autocast (16 bytes a
           parameter, the Trainer's `bf16=True`): the same model state as ours.
"""

import contextlib
import time

import torch

from model import get_model_args
from bench.peers.common import BETAS, GRAD_CLIP, WEIGHT_DECAY, Spec, step_inputs
from support import pretrained


def llama_config(model: str, dtype: torch.dtype):
    """transformers' LlamaConfig of our preset `model`."""
    from transformers import LlamaConfig

    return LlamaConfig.from_dict(pretrained.hf_config(get_model_args(model), dtype))


def enable_checkpointing(model) -> None:
    """transformers' gradient checkpointing with its defaults (renamed in transformers 5.2x)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or \
        model.gradient_checkpointing_enable
    enable()


class Stack:
    def __init__(self, spec: Spec, model: str, device: torch.device, init_from: str | None,
                 lr: float | None, seed: int):
        from transformers import AutoModelForCausalLM

        started = time.perf_counter()
        compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.weights_dtype = torch.float32 if spec.variant == "fp32" else compute
        self.autocast = (torch.autocast(device.type, dtype=compute)
                         if spec.variant == "fp32" and compute != torch.float32 else None)
        self.device = device
        torch.manual_seed(seed)
        if init_from:
            self.model = AutoModelForCausalLM.from_pretrained(
                init_from, attn_implementation="sdpa", dtype=self.weights_dtype).to(device)
        else:
            config = llama_config(model, self.weights_dtype)
            with torch.device(device):
                self.model = AutoModelForCausalLM.from_config(
                    config, attn_implementation="sdpa", dtype=self.weights_dtype)
        self.model.config.use_cache = False
        self.checkpoint = spec.checkpoint
        if spec.checkpoint:
            enable_checkpointing(self.model)
        self.model.train()
        self.vocab_size = self.model.config.vocab_size
        self.lr = lr if lr is not None else 3e-4
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, betas=BETAS,
                                           weight_decay=WEIGHT_DECAY, fused=fused)
        self.build_s = time.perf_counter() - started

    def prepare(self, seq_len: int) -> None:
        pass  # one model for every length

    def step(self, tokens: torch.Tensor) -> dict:
        input_ids, labels, positions = step_inputs(tokens, self.device)
        with self.autocast or contextlib.nullcontext():
            logits = self.model(input_ids=input_ids, position_ids=positions).logits
            # The model's loss function with labels already shifted: the same S targets as
            # ours (labels=... would shift once more and drop the last one).
            loss = self.model.loss_function(logits=logits, labels=None,
                                            vocab_size=self.vocab_size, shift_labels=labels)
        del logits
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss.detach()), "grad_norm": float(grad_norm)}

    def about(self) -> dict:
        import transformers

        return {
            "stack": "transformers LlamaForCausalLM",
            "transformers": transformers.__version__,
            "attention": f"sdpa ({self.model.config._attn_implementation})",
            "checkpointing": ("transformers' gradient checkpointing, non-reentrant, every layer"
                              if self.checkpoint else "none (+nockpt): all activations kept"),
            "weights": str(self.weights_dtype).removeprefix("torch.")
                       + (" + bf16 autocast" if self.autocast else ""),
            "optimizer": f"torch AdamW fused, {str(self.weights_dtype).removeprefix('torch.')} "
                         f"state",
            "loss": "model.loss_function on the full logits (fp32 upcast)",
            "lr": self.lr, "build_s": self.build_s,
        }
