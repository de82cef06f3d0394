"""alst: DeepSpeed's Arctic Long Sequence Training on one GPU, as ArcticTraining's one-GPU
recipes (projects/sequence-parallelism/run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml, and
their trainer code) set it up, on transformers' LlamaForCausalLM:

  - DeepSpeed ZeRO-3 (`deepspeed.initialize`, a process group of one), bf16, gradient clipping
    1.0; the recipe's own zero_optimization (stage 3, nothing else set: DeepSpeed's defaults).
    With +offload its offload_optimizer and offload_param to the CPU with DeepSpeedCPUAdam (the
    recipe's `cpu_adam`; refused before it builds, as out of memory, where the host cannot hold
    its 18 bytes a parameter); without, the model state on the GPU with DeepSpeed's FusedAdam (the
    trainer's `fused_adam`; a torch fused AdamW where that op does not build).
  - tiled MLP (`tiled_mlp_compute: true`): LlamaMLP.forward patched, before the model exists,
    to run DeepSpeed's TiledMLP over ceil(seq_len / hidden) shards (ArcticTraining's
    tiled_compute.py).
  - the model built by Liger-Kernel's AutoLigerKernelForCausalLM (`model.type: liger`) with
    swiglu=False (the tiled MLP replaces it): Liger's RMSNorm, rotary and fused linear
    cross-entropy (no logits tensor). @tiledloss, or where Liger cannot run (the CPU): DeepSpeed's
    TiledFusedLogitsLoss over ~1 GiB fp32 logit shards instead, as ArcticTraining's trainer does
    for models Liger does not cover.
  - activation checkpointing (transformers' gradient checkpointing, which ArcticTraining turns
    on) with the checkpoints offloaded to the CPU (`activation_checkpoint_cpu_offload: true`).
    ArcticTraining does that with a patch of torch's reentrant CheckpointFunction (a blocking
    copy of each layer's input); DeepSpeed >= 0.19 ships its successor for transformers'
    non-reentrant checkpointing, CheckpointHiddenStatesOffload (pinned buffers, copies on a side
    stream): we use DeepSpeed's, the faster of the two.
  - attention: the recipe's flash_attention_3 where installed, else FlashAttention-4 or 2
    through transformers where installed, else sdpa (the run records which).
  - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (run.py sets it for every stack).

Each rank of a real run agrees on the MLP's shard count with an all-reduce; one rank needs none.
"""

import contextlib
import glob
import math
import os
import shutil
import socket
import time

import torch

from bench.peers.common import BETAS, GRAD_CLIP, WEIGHT_DECAY, Spec, step_inputs
from bench.peers.hf import enable_checkpointing, llama_config
import model as llama
from support.host_memory import available_host_memory

# ZeRO-3's offload of parameters and optimizer keeps, per parameter, bf16 weights, fp32 master
# weights, fp32 gradients and AdamW's two fp32 moments on the host: 18 bytes (DeepSpeed's own
# estimate_zero3_model_states_mem_needs asks 1.5 times that)
ZERO_OFFLOAD_HOST_BYTES = 18
LOSS_SHARD_BYTES = 2**30  # ArcticTraining's TiledFusedLogitsLoss shards: ~1 GiB of fp32 logits


def join_group_of_one() -> None:
    """The environment deepspeed.init_distributed reads, for one process; CUDA_HOME for the
    ops DeepSpeed compiles on first use (nvcc on the PATH)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    # torch's CUDA and nvcc's may differ in their minor version (13.0 and 13.x): DeepSpeed's
    # builder refuses that unless told; the ops it builds here use nothing version-specific.
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")
    nvcc = shutil.which("nvcc")
    homes = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    for home in homes + ["/usr/local/cuda"]:  # nvcc may be a wrapper script outside its home
        if "CUDA_HOME" not in os.environ and os.path.exists(f"{home}/include/cuda_runtime.h"):
            os.environ["CUDA_HOME"] = home


def clear_stale_build_locks() -> None:
    """torch's extension builds (DeepSpeed's ops) take a lock file in their build folder; a
    process stopped mid-build (run.py's budget) leaves it, and the next build would wait on it
    forever. The stacks run one at a time, so a lock found now is stale."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    for lock in glob.glob(f"{root}/*/lock") + glob.glob(f"{root}/*/*/lock"):
        with contextlib.suppress(OSError):
            os.remove(lock)


def tiled_mlp_forward(self, x):
    """LlamaMLP.forward through DeepSpeed's TiledMLP: ceil(seq_len / hidden) shards along the
    sequence, each recomputed in backward; only the shard's intermediate activations exist."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    seq_len, hidden = x.shape[-2:]
    shards = math.ceil(seq_len / hidden)

    def mlp(module, part):
        return module.down_proj(module.act_fn(module.gate_proj(part)) * module.up_proj(part))

    weights = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp, self, x, shards, weights)


def attention_implementations(device: torch.device, variant: str) -> list:
    """The recipe's FlashAttention-3 where installed, else FA4 or FA2 where transformers has
    them, then sdpa (@sdpa: sdpa alone): the first that builds is used."""
    if device.type != "cuda" or variant == "sdpa":
        return ["sdpa"]
    from transformers import utils

    found = []
    for name, check in (("flash_attention_3", "is_flash_attn_3_available"),
                        ("flash_attention_4", "is_flash_attn_4_available"),
                        ("flash_attention_2", "is_flash_attn_2_available")):
        with contextlib.suppress(Exception):  # a broken install: the next one
            if getattr(utils, check, lambda: False)():
                found.append(name)
    return found + ["sdpa"]


def ds_config(spec: Spec, bf16: bool) -> dict:
    zero = {"stage": 3}
    if spec.offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    return {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1,
            "gradient_accumulation_steps": 1, "sequence_parallel_size": 1,
            "bf16": {"enabled": bf16}, "zero_optimization": zero,
            "gradient_clipping": GRAD_CLIP, "prescale_gradients": False,
            "zero_allow_untested_optimizer": True,  # the torch AdamW fallback
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def check_host_fits_offload(model: str) -> None:
    """Refuse, before DeepSpeed builds anything, a ZeRO offload that this host's memory cannot
    hold (the kernel's OOM killer would end the process minutes in, with no row); the message
    reads as running out of memory, so a choice 'A|B' records it as a fit, not an error."""
    n_params = llama.num_params(llama.get_model_args(model))
    needed, available = ZERO_OFFLOAD_HOST_BYTES * n_params, available_host_memory()
    if available is not None and needed > available:
        raise MemoryError(f"out of memory on the host: ZeRO's offload keeps "
                          f"{ZERO_OFFLOAD_HOST_BYTES} bytes a parameter on the host, "
                          f"{needed / 2**30:.1f} GiB for {model} ({n_params / 1e9:.2f}B "
                          f"parameters), where {available / 2**30:.1f} GiB is available")


def make_optimizer(model, spec: Spec, lr: float, device: torch.device):
    """(optimizer, what it is): the recipe's DeepSpeed Adam (built on first use), else torch's."""
    adamw = {"lr": lr, "betas": BETAS, "weight_decay": WEIGHT_DECAY}
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        if spec.offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, adamw_mode=True, **adamw), "DeepSpeedCPUAdam"
        if device.type == "cuda":
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(params, adam_w_mode=True, **adamw), "DeepSpeed FusedAdam"
    except Exception as error:  # noqa: BLE001 - an op that does not build here
        print(f"alst: DeepSpeed's Adam did not build ({str(error).splitlines()[0][:200]}); "
              f"torch AdamW instead", flush=True)
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, fused=fused, **adamw), "torch AdamW" + (" fused" * fused)


class Stack:
    def __init__(self, spec: Spec, model: str, device: torch.device, init_from: str | None,
                 lr: float | None, seed: int):
        started = time.perf_counter()
        if spec.offload:
            check_host_fits_offload(model)
        join_group_of_one()
        clear_stale_build_locks()
        import deepspeed
        from deepspeed.utils import logger as ds_logger
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.models.llama import modeling_llama

        ds_logger.setLevel("WARNING")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        self.device, self.spec = device, spec
        bf16 = device.type == "cuda"
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.config = ds_config(spec, bf16)
        modeling_llama.LlamaMLP.forward = tiled_mlp_forward  # before the model is built
        self.liger = (spec.variant != "tiledloss" and device.type == "cuda"
                      and _liger_importable())
        options = {"dtype": dtype}
        if self.liger:
            from liger_kernel.transformers import AutoLigerKernelForCausalLM as auto_class

            options["swiglu"] = False
        else:
            auto_class = AutoModelForCausalLM
        self._keep_alive = HfDeepSpeedConfig(self.config)  # zero.Init while the model is built
        self.attention_refused = {}
        for attention in attention_implementations(device, spec.variant):
            torch.manual_seed(seed)
            try:  # transformers refuses an implementation it cannot run before building
                if init_from:
                    model_ = auto_class.from_pretrained(init_from, attn_implementation=attention,
                                                        **options)
                else:
                    model_ = auto_class.from_config(llama_config(model, dtype),
                                                    attn_implementation=attention, **options)
            except (ImportError, ValueError) as error:
                self.attention_refused[attention] = str(error).splitlines()[0][:200]
                print(f"alst: {attention} refused ({self.attention_refused[attention]})",
                      flush=True)
                continue
            self.attention = attention
            break
        model_.config.use_cache = False
        enable_checkpointing(model_)
        model_.enable_input_require_grads()  # as ArcticTraining does for checkpointing
        self.vocab_size = model_.config.vocab_size
        self.lr = lr if lr is not None else 3e-4
        optimizer, self.optimizer_name = make_optimizer(model_, spec, self.lr, device)
        self.engine, *_ = deepspeed.initialize(model=model_, optimizer=optimizer,
                                               config=self.config)
        self.offload = None
        self.offloaded_bytes = None
        self.build_s = time.perf_counter() - started

    def prepare(self, seq_len: int) -> None:
        """A fresh checkpoint offloader per length: its pinned buffer pool is kept by shape."""
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            get_checkpoint_hidden_states_offloading_ctx_manager,
        )

        self.offload = None
        self.offload = get_checkpoint_hidden_states_offloading_ctx_manager()

    def step(self, tokens: torch.Tensor) -> dict:
        input_ids, labels, positions = step_inputs(tokens, self.device)
        with self.offload:
            if self.liger:  # Liger's forward: fused linear cross-entropy on shift_labels
                loss = self.engine(input_ids=input_ids, position_ids=positions,
                                   shift_labels=labels).loss
            else:
                loss = self.tiled_loss(input_ids, labels, positions)
            self.engine.backward(loss)
        self.offloaded_bytes = self.offload.stats.offloaded_bytes
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        return {"loss": float(loss.detach()),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "checkpoints_offloaded_gib": round(self.offloaded_bytes / 2**30, 3)}

    def tiled_loss(self, input_ids, labels, positions) -> torch.Tensor:
        """DeepSpeed's TiledFusedLogitsLoss: the decoder's hidden states, then logits and loss
        one ~1 GiB shard of fp32 logits at a time, its backward done in the forward.

        Reduced as "mean" over equal shards (the fewest that divide the sequence): the shards'
        weight gradients are made in the forward with the reduction's own factor, so a "sum"
        divided afterwards (as ArcticTraining's trainer does) would leave lm_head's gradient
        undivided: the CPU check measured a gradient norm of 125 against ours' 0.77."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        model = self.engine.module
        hidden = model.model(input_ids=input_ids, position_ids=positions).last_hidden_state
        shards = max(1, math.ceil(labels.numel() * self.vocab_size * 4 / LOSS_SHARD_BYTES))
        while labels.shape[1] % shards:
            shards += 1

        def shard_loss(module, hidden_part, labels_part):
            logits = module.lm_head(hidden_part)
            return module.loss_function(logits=logits, labels=None, vocab_size=self.vocab_size,
                                        shift_labels=labels_part)

        return TiledFusedLogitsLoss.apply(shard_loss, model, hidden, labels, None, shards,
                                          [model.lm_head.weight], "mean")

    def about(self) -> dict:
        import deepspeed
        import transformers

        return {
            "stack": "DeepSpeed ALST (ArcticTraining's one-GPU recipe) on LlamaForCausalLM",
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "liger_kernel": _liger_version() if self.liger else None,
            "zero_optimization": self.config["zero_optimization"],
            "attention": self.attention, "attention_refused": self.attention_refused,
            "mlp": "DeepSpeed TiledMLP, ceil(seq_len / hidden) shards",
            "loss": ("Liger fused linear cross-entropy" if self.liger
                     else "DeepSpeed TiledFusedLogitsLoss, equal shards of <= ~1 GiB fp32 "
                          "logits, mean"),
            "checkpointing": "transformers' gradient checkpointing, non-reentrant, inputs "
                             "offloaded by DeepSpeed's CheckpointHiddenStatesOffload",
            "weights": "bf16 params, fp32 master and AdamW state (ZeRO-3 bf16)",
            "optimizer": self.optimizer_name, "lr": self.lr, "build_s": self.build_s,
        }


def _liger_importable() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or no triton/GPU
        return False
    return True


def _liger_version() -> str | None:
    from importlib.metadata import version

    with contextlib.suppress(Exception):
        return version("liger_kernel")
    return None
