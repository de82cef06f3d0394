"""A pretrained Llama-3-8B in and out on the GPUs: --init-from, one step at length, --export-hf.

    python -m bench.pretrained write /tmp/llama3-8b-hf                       # an 8B-shaped folder
    torchrun --nproc-per-node 2 -m bench.pretrained run /tmp/llama3-8b-hf /tmp/exported \
        --name pretrained_llama3-8b_2gpu -- --stack 5 --seq-len 128K         # train.py's flags
    python -m bench.pretrained reference /tmp/llama3-8b-hf /tmp/exported \
        --name pretrained_llama3-8b_2gpu                                     # one GPU, transformers
    python -m bench.pretrained write /tmp/t --model tiny && python -m bench.pretrained run /tmp/t \
        /tmp/t-out --device cpu -- --stack 1 --seq-len 256 && \
        python -m bench.pretrained reference /tmp/t /tmp/t-out --device cpu   # CPU smoke form

No real weights can be downloaded on the GPU machine, so `write` makes a Hugging Face folder of
the preset's shape (config.json from pretrained.hf_config, ~5 GB safetensors shards, an index)
with random bf16 weights (normal, std 0.02; norms 1): the bytes and the layout of a published
Llama-3-8B, not its values.

`run` (torchrun, train.py's own functions and flags): builds the model with --init-from (each
rank reads only its slices), times that and records each rank's peak host memory (ru_maxrss: the
mapped file pages it touched included) and the GPU bytes it holds; the loss of a short window
(--short, default 4K tokens, no update); one training step at --seq-len (the first-step loss, its
time and peak); the short window's loss again (after the update); then --export-hf into the second
folder, timed.

`reference` (one process, one GPU): transformers loads the written folder in fp32 and computes the
short window's loss (an outside reference for the first one), then loads the exported folder and
computes it again (the export holds the trained weights: it must give `run`'s second short loss).
Both are added to the JSON `run` wrote. bf16 against fp32: ~1e-2 relative is the arithmetic.
"""

import argparse
import dataclasses
import importlib
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import model as llama
from support import choices, pretrained, progress
from bench.report import default_out_dir, end_distributed, refuse_without_gpu, write_result
from support.data import parse_tokens

train = importlib.import_module("train")
GiB = 2**30


def short_window(vocab_size: int, length: int) -> torch.Tensor:
    """(1, length + 1) fixed random tokens: the same window for `run` and `reference`."""
    return torch.randint(0, vocab_size, (1, length + 1), generator=torch.Generator().manual_seed(1))


def write_folder(out_dir: str, preset: str, shard_bytes: int, device: str) -> dict:
    """An HF folder of `preset`'s shape with random weights, written tensor by tensor."""
    from safetensors.torch import save_file

    args = llama.get_model_args(preset)
    with torch.device("meta"):
        names = {pretrained.hf_name(n): p.shape for n, p in llama.Transformer(args).named_parameters()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)  # never over an existing folder
    generator = torch.Generator(device=device).manual_seed(0)
    shards, shard, size, started = [], {}, 0, time.perf_counter()

    def flush():
        if shard:
            shards.append(dict(shard))
            save_file(shard, out / f"part-{len(shards):05d}.safetensors", metadata={"format": "pt"})
            shard.clear()

    for name, shape in names.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (0.02 * torch.randn(shape, device=device, generator=generator)).bfloat16().cpu()
        if size and size + tensor.nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = tensor
        size += tensor.nbytes
    flush()
    count = len(shards)
    weight_map, total = {}, 0
    for i, part in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        os.rename(out / f"part-{i:05d}.safetensors", out / final)
        for name, tensor in part.items():
            weight_map[name] = final
            total += tensor.nbytes
    (out / pretrained.INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(pretrained.hf_config(args), indent=1))
    return {"bytes": total, "files": count, "write_s": time.perf_counter() - started}


def host_peak_gib() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def run(folder: str, export_dir: str, train_argv: list[str], short: int, out_dir: str | None,
        name: str) -> None:
    cfg = train.parse_args(["--init-from", folder, "--steps", "1", "--export-hf", export_dir,
                            *train_argv])
    rt = train.setup_runtime(cfg)
    args = train.model_args(cfg)
    cuda = rt.device.type == "cuda"
    cfg.head_chunk = choices.choose_head_chunk(cfg, rt)
    host_before = host_peak_gib()
    start = time.perf_counter()
    model = train.build_model(cfg, rt)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    per_rank = {"load_host_peak_gib": host_peak_gib(), "host_peak_before_load_gib": host_before,
                "gpu_after_load_gib": torch.cuda.memory_allocated() / GiB if cuda else None}
    optimizer = train.make_optimizer(model, cfg)

    def short_loss():  # forward (and a backward whose gradients are dropped): no update
        loss = float(train.forward_backward(model, short_window(args.vocab_size, short), rt))
        optimizer.zero_grad(set_to_none=True)
        return loss

    before = short_loss()
    tokens = torch.randint(0, args.vocab_size, (1, cfg.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    metrics = train.train_step(model, optimizer, tokens, rt, cfg)
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    step_peak = torch.cuda.max_memory_allocated() / GiB if cuda else None
    after = short_loss()
    start = time.perf_counter()
    pretrained.export_hf(model, args, export_dir, dtype=getattr(torch, cfg.dtype), source_dir=folder,
                         max_position_embeddings=max(cfg.seq_len, args.rope_original_context))
    export_s = time.perf_counter() - start
    per_rank.update(step_peak_gpu_gib=step_peak, host_peak_gib=host_peak_gib())
    gathered = [per_rank]
    if torch.distributed.is_initialized():
        gathered = [None] * rt.world
        torch.distributed.all_gather_object(gathered, per_rank)
    if rt.rank == 0:
        checkpoint_gib = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / GiB
        result = {"what": "--init-from an HF folder, one step, --export-hf (bench/pretrained.py)",
                  "folder": folder, "checkpoint_gib": checkpoint_gib,
                  "parameters": llama.num_params(args),
                  "train_args": train_argv, "config": dataclasses.asdict(cfg), "dp": rt.dp,
                  "sp": rt.sp, "head_chunk": cfg.head_chunk,
                  "attention_kernel": progress.attention_kernel(cfg, rt, args),
                  "load_s": load_s, "step_s": step_s, "export_s": export_s,
                  "first_step_loss": metrics["loss"], "seq_len": cfg.seq_len,
                  "short_tokens": short, "short_loss_before_step": before,
                  "short_loss_after_step": after, "ranks": gathered}
        write_result(name, result, out_dir)
        print(json.dumps({k: v for k, v in result.items() if k not in ("config", "ranks")}, default=str))
        for r, row in enumerate(gathered):
            print(f"rank {r}: {row}")
    end_distributed()


def reference(folder: str, export_dir: str, result_path: str, device: str) -> None:
    """transformers' short-window loss on the written folder and on the export (fp32, one device)."""
    from transformers import AutoModelForCausalLM

    result = json.loads(Path(result_path).read_text())
    tokens = short_window(json.loads((Path(folder) / "config.json").read_text())["vocab_size"],
                          result["short_tokens"]).to(device)
    for key, path, ours in (("reference", folder, result["short_loss_before_step"]),
                            ("export", export_dir, result["short_loss_after_step"])):
        start = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(  # straight onto the GPU: 32 GB in fp32
            path, dtype=torch.float32, device_map=device if device == "cuda" else None).to(device)
        load_s = time.perf_counter() - start
        with torch.no_grad():
            logits = hf(input_ids=tokens[:, :-1]).logits
            loss = float(F.cross_entropy(logits.flatten(0, 1).float(), tokens[0, 1:]))
        result[f"{key}_transformers"] = {
            "folder": path, "load_s": load_s, "short_loss": loss, "ours": ours,
            "relative_difference": abs(ours - loss) / abs(loss)}
        print(key, result[f"{key}_transformers"], flush=True)
        del hf, logits
        if device == "cuda":
            torch.cuda.empty_cache()
    Path(result_path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["write", "run", "reference"])
    parser.add_argument("folder", help="the Hugging Face folder (written by `write`)")
    parser.add_argument("export", nargs="?", help="run/reference: the exported folder")
    parser.add_argument("--model", default="llama3-8b", help="write: the preset's shape")
    parser.add_argument("--shard-gib", type=float, default=5.0, help="write: safetensors shard size")
    parser.add_argument("--short", default="4K", help="run: the short window's tokens")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default="pretrained", help="run/reference: the result is --out/NAME.json")
    parser.add_argument("--out", default=None)
    opts, train_argv = parser.parse_known_args()
    train_argv = [a for a in train_argv if a != "--"]
    if opts.what == "write":
        refuse_without_gpu("pretrained.py", opts.model, opts.device,
                           "python -m bench.pretrained write /tmp/t --model tiny")
        print(write_folder(opts.folder, opts.model, int(opts.shard_gib * GiB), opts.device))
    elif opts.what == "run":
        if not opts.export:
            parser.error("run needs the export folder")
        device = ["--device", opts.device] + (["--dtype", "float32"] if opts.device == "cpu" else [])
        run(opts.folder, opts.export, device + train_argv, parse_tokens(opts.short), opts.out,
            opts.name)
    else:
        path = Path(opts.out or default_out_dir()) / f"{opts.name}.json"
        if not path.exists():
            parser.error(f"{path} does not exist: run `run` first, with the same --name and --out")
        reference(opts.folder, opts.export, str(path), opts.device)


if __name__ == "__main__":
    main()
