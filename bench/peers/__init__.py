"""bench/peers: the same model and lengths through three stacks on one GPU, side by side.

    python -m bench.peers.run --model llama3.2-3b --seq-lens 16K 32K 64K --steps 2 \\
        --out peers.json                         # each stack at its best (the default stacks)
    python -m bench.peers.run --stacks ours:4 ours:5 ours:5@cudnn alst hf \\
        --model llama3.2-3b --seq-lens 64K 128K --steps 3 --out peers.json
    python -m bench.peers.run --check-loss 4K --stacks ours:5 alst hf --out peers_check.json

One process per stack, one after another, bf16, AdamW, batch 1, random init from the same
config (our preset; transformers' LlamaConfig made from it by support/pretrained.hf_config):

  ours:N|auto[@KERNEL][+offload][+overlap|+nooverlap|+moments]  train.py --stack N (or auto:
                             train.py's fastest plan that fits, plan.plan_run) through its own
                             functions (bench/peers/ours.py); @KERNEL its --attn-kernel,
                             +offload its --offload-model-state, +overlap its
                             --overlap-optimizer (08), +nooverlap --no-overlap-optimizer
                             (neither: 08 as the plan decides), +moments its
                             --offload-moments (09, with 08).
  alst[@VARIANT][+offload]   DeepSpeed's Arctic Long Sequence Training as ArcticTraining's
                             one-GPU recipe sets it up: ZeRO-3, TiledMLP, Liger's fused linear
                             cross-entropy, checkpoints offloaded to the CPU, FlashAttention where
                             transformers has it (bench/peers/alst.py); @tiledloss: DeepSpeed's
                             TiledFusedLogitsLoss instead of Liger's, @sdpa: attention by SDPA;
                             +offload: ZeRO's optimizer and parameter offload, as the recipe.
  hf[@fp32][+nockpt]         transformers alone: SDPA, gradient checkpointing (+nockpt: none),
                             torch AdamW (bench/peers/hf.py; bf16 weights and moments, @fp32:
                             fp32 + autocast).
  A|B                        a choice: A, and B only where A runs out of memory (run.py). The
                             default stacks are each at its best: ours:auto, hf+nockpt|hf,
                             alst|alst+offload (common.BEST).

run.py says what a row measures, the budget and the loss check.

DeepSpeed and Liger-Kernel are this benchmark's dependencies only (never requirements.txt):
    pip install deepspeed==0.19.8 liger-kernel==0.8.5    # DeepSpeed builds its ops on first use
Without network (the GPU machine), as wheels: DeepSpeed is published as source only, so build it
on any machine with torch (its ops are compiled where it runs, with nvcc and ninja):
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda pip wheel --no-deps --no-build-isolation \\
        deepspeed==0.19.8 -w .whl
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 -d .whl liger-kernel==0.8.5 hjson==3.1.0 \\
        pydantic==2.11.10 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.2
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
(The rest of DeepSpeed's needs, einops, msgpack, ninja, numpy, psutil, py-cpuinfo, tqdm and
nvidia-ml-py, are common; pydantic 2.11 needs typing-extensions >= 4.12.2.)
"""
