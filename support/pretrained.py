"""Pretrained checkpoints in and out: Hugging Face Llama / Qwen3 folders <-> our (sharded) model.

Nobody trains a long-context model from random weights: million-token training extends a model
that was pretrained at 8K-128K tokens. So a run starts from a Hugging Face folder (config.json,
*.safetensors) and should end with one that `transformers` opens. Two things make this harder
than `model.load_state_dict(torch.load(...))` under FSDP:

  - Loading whole, then sharding: Llama-3-8B is 16 GB in bf16 (32 GB in fp32), and every rank of
    a node would hold it at once: 8 ranks x 16 GB = 128 GB of host memory, for a moment, to keep
    1/8 of it each. Instead each rank reads only its FSDP slice of each tensor straight from the
    memory-mapped safetensors files (torch.distributed.checkpoint's Hugging Face reader plans
    exactly those reads: its `get_slice(name)[rows]` touches only the bytes of those rows).
  - Saving: each rank holds 1/N of each tensor, and transformers wants whole tensors in one
    folder. export_hf gathers one tensor at a time (`full_tensor()`, a collective) and rank 0
    writes it: host memory of one shard file, never of the model.

Our weight names are Hugging Face's without the leading "model." (model.py), so the mapping is one
line (`hf_name`). What our model cannot compute (biases, sliding windows, MoE, other rotary types)
is refused when the config is read, naming the field, before anything is allocated or loaded.

    args = model_args_from_hf(path)                  # ModelArgs from config.json
    model = build_model(args, device, mesh, ...)     # support/build.py: sharded
    load_hf_weights(model, path)                     # each rank reads its slices
                                                     # (the three: build.build_from_hf)
    ...train...
    export_hf(model, args, out_dir)                  # config.json + safetensors + index
"""

import json
import math
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist

from model import ROPE_SCALINGS, ModelArgs
from support import paths

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header
# Tensors some older checkpoints carry that are recomputed, not learned: skipped on load.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Fields that mean a mixture of experts (any of them set: refused).
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
              "num_experts_per_tok")


# ---------------------------------------------------------------------------------------------
# config.json -> ModelArgs, and back
# ---------------------------------------------------------------------------------------------

def read_hf_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path!r} is not a Hugging Face model folder: no config.json")
    with open(config_path) as f:
        try:
            return json.load(f)
        except ValueError as caught:
            raise ValueError(f"{config_path!r} is not valid JSON: {caught}") from None


def model_args_from_hf(path_or_config) -> ModelArgs:
    """ModelArgs from a Hugging Face folder (or its parsed config.json) of LlamaForCausalLM or
    Qwen3ForCausalLM. Reads transformers v5's `rope_parameters` and v4's `rope_theta` +
    `rope_scaling`. Refuses (ValueError naming the field) what model.py cannot compute."""
    config = read_hf_config(path_or_config) if isinstance(path_or_config, str) else path_or_config
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"architectures={archs}: only {sorted(ARCHITECTURES)} are supported")
    family = ARCHITECTURES[archs[0]]
    if config.get("model_type", family) != family:
        raise ValueError(f"model_type={config['model_type']!r} does not match {archs[0]}")

    def refuse_if(condition, field, why):
        if condition:
            raise ValueError(f"{field}={config.get(field)!r}: {why}, which model.py does not have")

    refuse_if(config.get("hidden_act", "silu") != "silu", "hidden_act", "not SwiGLU with silu")
    refuse_if(config.get("attention_bias", False), "attention_bias", "biases in q/k/v/o")
    refuse_if(config.get("mlp_bias", False), "mlp_bias", "biases in the MLP")
    for field in MOE_FIELDS:
        refuse_if(config.get(field), field, "a mixture of experts")
    refuse_if(config.get("use_sliding_window", False), "use_sliding_window",
              "sliding-window attention")
    refuse_if(any(t != "full_attention" for t in config.get("layer_types") or []), "layer_types",
              "layers other than full attention")
    refuse_if(config.get("partial_rotary_factor", 1.0) != 1.0, "partial_rotary_factor",
              "rotary over part of a head")

    hidden, n_heads = config["hidden_size"], config["num_attention_heads"]
    rope = rope_fields_from_hf(config)
    # a field left out is read as transformers' config class reads it: LlamaConfig derives the
    # KV heads and head_dim from the heads, Qwen3Config has defaults of its own (32 and 128)
    qwen3 = family == "qwen3"
    return ModelArgs(
        dim=hidden, n_layers=config["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", 32 if qwen3 else None) or n_heads,
        head_dim=config.get("head_dim", 128 if qwen3 else None) or hidden // n_heads,
        ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=family == "qwen3", eos_id=first_id(config.get("eos_token_id")), **rope)


def first_id(ids):
    """eos_token_id is an int, a list of ints (several end tokens), or absent."""
    return ids[0] if isinstance(ids, list) and ids else ids if isinstance(ids, int) else None


def rope_fields_from_hf(config: dict) -> dict:
    """The ModelArgs rope_* fields of a config: v5 `rope_parameters` (with rope_theta inside) or
    v4 `rope_theta` + `rope_scaling` (None for plain rotary)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope_parameters={params}: rotary per layer type is not supported")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']}:"
                         f" rotary over part of a head is not supported")
    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if rope_type not in ("llama3", "yarn"):
        raise ValueError(f"rope_type={rope_type!r}: only default, llama3 and yarn are supported")
    original = params.get("original_max_position_embeddings",
                          config.get("original_max_position_embeddings",
                                     config.get("max_position_embeddings")))
    fields = {"rope_theta": float(theta), "rope_scaling": rope_type,
              "rope_original_context": int(original)}
    if rope_type == "llama3":
        fields.update(rope_factor=float(params["factor"]),
                      rope_low_freq_factor=float(params["low_freq_factor"]),
                      rope_high_freq_factor=float(params["high_freq_factor"]))
        return fields
    # yarn, with transformers' defaults and its way of inferring what is missing
    factor = params.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        def get_mscale(scale, m):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    fields.update(rope_factor=float(factor),
                  rope_beta_fast=float(params.get("beta_fast") or 32),
                  rope_beta_slow=float(params.get("beta_slow") or 1),
                  rope_attention_factor=None if attention is None else float(attention),
                  rope_truncate=bool(params.get("truncate", True)))
    return fields


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.bfloat16,
              max_position_embeddings: int | None = None, extra: dict | None = None) -> dict:
    """A config.json for `args` that transformers v5 and v4 both read: rope settings both as v5's
    `rope_parameters` and as v4's `rope_theta` + `rope_scaling`."""
    if args.rope_scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling={args.rope_scaling!r}; choose one of {ROPE_SCALINGS}")
    qwen = args.qk_norm
    scaling = None
    if args.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": args.rope_factor,
                   "low_freq_factor": args.rope_low_freq_factor,
                   "high_freq_factor": args.rope_high_freq_factor,
                   "original_max_position_embeddings": args.rope_original_context}
    elif args.rope_scaling == "yarn":
        scaling = {"rope_type": "yarn", "factor": args.rope_factor,
                   "original_max_position_embeddings": args.rope_original_context,
                   "beta_fast": args.rope_beta_fast, "beta_slow": args.rope_beta_slow,
                   "truncate": args.rope_truncate}
        if args.rope_attention_factor is not None:  # else transformers derives it from factor
            scaling["attention_factor"] = args.rope_attention_factor
    if args.rope_scaling == "yarn":
        # transformers reads yarn's factor against max_position_embeddings / the original context
        # (and warns when the two disagree): the post-yarn context is original x factor.
        max_position_embeddings = int(args.rope_original_context * args.rope_factor)
    elif args.rope_scaling == "llama3":
        # at least the context the scaling stretches to (transformers warns where the original
        # context is not below it: a run shorter than the original would say so)
        max_position_embeddings = max(max_position_embeddings or 0,
                                      int(args.rope_original_context * args.rope_factor))
    elif max_position_embeddings is None:  # a hint for generation tools; our rotary has no limit
        max_position_embeddings = 131072
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": ["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen else "llama",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": args.rope_theta},
        "torch_dtype": dtype_name, "dtype": dtype_name, "use_cache": True,
    }
    if qwen:
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=args.n_layers,
                      layer_types=["full_attention"] * args.n_layers)
    else:
        config.update(mlp_bias=False, pretraining_tp=1)
    if args.eos_id is not None:
        config["eos_token_id"] = args.eos_id
    config.update(extra or {})
    return config


# ---------------------------------------------------------------------------------------------
# Names, files, and the checks made before a single weight is read
# ---------------------------------------------------------------------------------------------

def hf_name(name: str) -> str:
    """Our parameter name -> the checkpoint's: "model." in front, except lm_head. Wrappers some
    techniques may add around modules (activation checkpointing, torch.compile) are dropped."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name if name.startswith("lm_head.") else f"model.{name}"


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file path, from model.safetensors.index.json if there is one,
    else from the single model.safetensors (or the only *.safetensors). Raises ValueError for a
    folder without weights or an index naming a file that is not there."""
    read_hf_config(path)  # a clear error for a folder that is not a model
    index_path = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        missing = sorted({file for file in weight_map.values()
                          if not os.path.isfile(os.path.join(path, file))})
        if missing:
            raise ValueError(f"{index_path} names files that are not in {path!r}: {missing}")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if SINGLE_NAME in files:
        files = [SINGLE_NAME]
    if len(files) != 1:
        raise ValueError(f"{path!r}: no {INDEX_NAME} and "
                         + ("no *.safetensors file" if not files else f"several files {files}"))
    file = os.path.join(path, files[0])
    return dict.fromkeys(safetensors_header(file), file)


def safetensors_header(file: str) -> dict:
    """A safetensors file's header, tensor name -> {dtype, shape, data_offsets}, read without its
    data; a ValueError naming the file where the header is damaged or the file is not as long
    as the header says (an interrupted download), as safetensors itself would refuse it later."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 8 + length <= min(size, 8 + MAX_HEADER_BYTES):
                raise ValueError(f"its header's length ({length:,} bytes) does not fit the file")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as caught:
        raise ValueError(f"{file!r} is not a readable safetensors file ({size:,} bytes): "
                         f"{caught}") from None
    if size != 8 + length + end:
        raise ValueError(f"{file!r} is {'cut short' if size < 8 + length + end else 'too long'}: "
                         f"its header promises {8 + length + end:,} bytes, the file has {size:,}"
                         + (" (an interrupted download?)" if size < 8 + length + end else ""))
    return header


def check_weight_files(path: str) -> None:
    """Every weights file of the Hugging Face folder `path` whole, by its header (no data read)."""
    for file in sorted(set(checkpoint_files(path).values())):
        safetensors_header(file)


def checkpoint_shapes(path: str) -> dict[str, tuple]:
    """Tensor name -> shape, from the safetensors headers alone (no tensor data is read)."""
    files = checkpoint_files(path)
    shapes = {}
    for file in sorted(set(files.values())):
        for name, entry in safetensors_header(file).items():
            if files.get(name) == file:
                shapes[name] = tuple(entry["shape"])
    missing = sorted(set(files) - set(shapes))
    if missing:
        raise ValueError(f"{path!r}: the index names tensors its files do not hold: {missing}")
    return shapes


def _wanted(model) -> dict[str, torch.Tensor]:
    """The checkpoint name -> our tensor (a DTensor shard under FSDP2) that load_hf_weights fills.
    A tied lm_head is embed_tokens itself: not loaded twice."""
    state = model.state_dict()
    if model.args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {hf_name(name): tensor for name, tensor in state.items()}


def check_checkpoint(model, path: str) -> dict[str, str]:
    """Raise ValueError listing every missing, unexpected and wrongly shaped tensor of the
    checkpoint in `path` against `model`; return name -> file. Reads headers only."""
    files = checkpoint_files(path)
    shapes = checkpoint_shapes(path)
    wanted = _wanted(model)
    ignored = {n for n in shapes if n.endswith(IGNORED_SUFFIXES)}
    if model.args.tie_word_embeddings:
        ignored.add("lm_head.weight")  # some tied checkpoints store the copy too
    problems = []
    missing = sorted(set(wanted) - set(shapes))
    if missing:
        problems.append(f"missing tensors {missing}")
    unexpected = sorted(set(shapes) - set(wanted) - ignored)
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    mismatched = [f"{n}: checkpoint {list(shapes[n])}, model {list(wanted[n].shape)}"
                  for n in sorted(set(wanted) & set(shapes)) if shapes[n] != tuple(wanted[n].shape)]
    if mismatched:
        problems.append(f"shape mismatches [{'; '.join(mismatched)}]")
    if problems:
        raise ValueError(f"checkpoint {path!r} does not fit the model: " + "; ".join(problems))
    return files


# ---------------------------------------------------------------------------------------------
# Load: each rank reads only its slices
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def load_hf_weights(model, path: str, use_dcp: bool = True) -> None:
    """Fill `model` (plain, or FSDP2-sharded with DTensor parameters) from the Hugging Face
    checkpoint in `path`, in place, each rank reading only the rows it holds. Any dtype in the
    files is cast to the parameters' dtype. Every check runs (on every rank, on the headers)
    before anything is read, so a refused checkpoint leaves the model as it was.

    use_dcp: torch.distributed.checkpoint with its HuggingFaceStorageReader (the planner reads
    exactly each DTensor's slice); False, or a torch without it: the same slices by hand with
    safetensors' get_slice."""
    files = check_checkpoint(model, path)
    wanted = _wanted(model)
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:
        use_dcp = False
    if use_dcp:
        import torch.distributed.checkpoint as dcp

        # The reader lists every *.safetensors file in the folder: with stray ones (not in the
        # index) the checks above did not cover, read by hand from the files the index names.
        on_disk = {os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")}
        if on_disk == set(files.values()):
            single = not (dist.is_available() and dist.is_initialized())
            with warnings.catch_warnings():  # "assuming ... a single process": yes, we are
                if single:
                    warnings.filterwarnings("ignore", message=".*single process")
                dcp.load(wanted, storage_reader=HuggingFaceStorageReader(path), no_dist=single)
            return
    _load_by_hand(wanted, files)


def _load_by_hand(wanted: dict[str, torch.Tensor], files: dict[str, str]) -> None:
    import safetensors

    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safetensors.safe_open(file, framework="pt") as f:
            for name in names:
                target = wanted[name]
                local, offsets = _local_part(target)
                if local.numel() == 0:
                    continue
                rows = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
                local.copy_(f.get_slice(name)[rows])


def _local_part(tensor: torch.Tensor):
    """(this rank's local tensor, its offset in the global tensor) for a DTensor or a tensor."""
    if not hasattr(tensor, "to_local"):
        return tensor, (0,) * tensor.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                       tensor.placements)
    return tensor.to_local(), tuple(offsets)


# ---------------------------------------------------------------------------------------------
# Export: gather one tensor at a time, rank 0 writes; atomic
# ---------------------------------------------------------------------------------------------

class ExportFailed(RuntimeError):
    """An export that could not be written (a full disk, say); nothing was replaced."""


def check_export_dir(out_dir: str, overwrite: bool = False) -> None:
    """Refuse, before anything is trained or written, an export folder that would destroy
    something (a file of that name, a folder that is not empty unless overwrite) or that can
    never be written (its nearest existing ancestor is a file or not writable)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"export: {out_dir!r} exists and is not a folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(f"export: {out_dir!r} is not empty (choose another folder, or "
                         f"--overwrite-export to replace it)")
    # The export is written beside out_dir and renamed into place: its parent must take files.
    paths.check_can_write("export:", out_dir)


def tokenizer_files(data_path: str | None, source_dir: str | None) -> tuple[list, dict]:
    """What makes an export usable alone with AutoTokenizer + generate: the tokenizer files to
    copy, as (path, name in the export), and the token ids for config.json. From the
    --init-from folder when it has a tokenizer, else from the tokenizer prepare_data.py used
    (named in the token file's sidecar), whose separator ends every document: the end-of-text
    id that generation stops at."""
    from support.data import sidecar_path

    def files_of(folder):
        return [(os.path.join(folder, f), f) for f in sorted(os.listdir(folder))
                if f.startswith(("tokenizer", "special_tokens_map", "generation_config"))]

    if source_dir is not None and any(name in ("tokenizer.json", "tokenizer.model")
                                      for _, name in files_of(source_dir)):
        return files_of(source_dir), {}
    if not data_path or not os.path.isfile(sidecar_path(data_path)):
        return (files_of(source_dir) if source_dir else []), {}
    with open(sidecar_path(data_path)) as f:
        info = json.load(f)
    tokenizer = info.get("tokenizer")
    if not tokenizer or not os.path.exists(tokenizer):
        return [], {}
    files = files_of(tokenizer) if os.path.isdir(tokenizer) else [(tokenizer, "tokenizer.json")]
    ids = {"eos_token_id": info["separator_id"]} if "separator_id" in info else {}
    return files, {**ids, "_eos_token": info.get("separator")}


def export_hf(model, args: ModelArgs, out_dir: str, overwrite: bool = False,
              dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 2**30,
              max_position_embeddings: int | None = None, source_dir: str | None = None,
              data_path: str | None = None) -> None:
    """Write `model` as a Hugging Face folder that transformers' from_pretrained opens:
    config.json, model-0000i-of-0000N.safetensors and model.safetensors.index.json.

    Call on every rank (the gathers are collectives); rank 0 writes. Tensors are gathered one at
    a time with full_tensor(), cast to `dtype` and written in shards of at most `max_shard_bytes`
    (one shard's bytes on rank 0's host at a time). A tied lm_head is not written (transformers
    ties it again on load). source_dir (the folder the run started from): its tokenizer and
    generation files and token ids are carried over, so the export is usable as is; without a
    tokenizer there, data_path's (the token file prepare_data.py wrote) is, with its end-of-text
    id. Files and folders get the permissions of the umask, like any file the user writes.

    Why not DCP's HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)?
    It does handle FSDP2 DTensors (tried on torch 2.14: the consolidated file is exact), but each
    rank first writes its shards to disk and rank 0 reads them back to consolidate, which needs a
    filesystem all ranks share, leaves a "sharded" subfolder, and writes no {"format": "pt"}
    header some transformers versions check. Gathering sends the bytes once, over the network.

    A non-empty out_dir is refused unless overwrite=True. Everything is written into a temporary
    folder beside out_dir and renamed into place at the end: a failure leaves no half export and
    the previous one (if any) untouched."""
    from safetensors.torch import save_file

    out_dir = os.path.abspath(out_dir)
    check_export_dir(out_dir, overwrite)
    copied, extra = tokenizer_files(data_path, source_dir)
    eos_token = extra.pop("_eos_token", None)
    if source_dir is not None:
        source = read_hf_config(source_dir)
        extra.update({k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if k in source})
    config = hf_config(args, dtype, max_position_embeddings, extra)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    state = model.state_dict()
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    names = list(state)
    # The shard plan from the shapes alone, so the file names (i of N) are known before writing.
    item_size = torch.tensor([], dtype=dtype).element_size()
    shards, size = [[]], 0
    for name in names:
        nbytes = state[name].numel() * item_size
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    error, tmp = None, None
    if rank == 0:
        try:
            parent = os.path.dirname(out_dir)
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"{type(e).__name__}: {e}"
    weight_map = {}
    for file_name, shard in zip(file_names, shards):
        tensors = {}
        for name in shard:
            tensor = state[name]
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # collective
            if rank == 0 and error is None:
                tensors[hf_name(name)] = full.detach().to("cpu", dtype).contiguous()
                weight_map[hf_name(name)] = file_name
            del full
        if rank == 0 and error is None:
            try:
                save_file(tensors, os.path.join(tmp, file_name), metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001 - keep gathering so the other ranks finish
                error = f"{type(e).__name__}: {e}"
        del tensors
    if rank == 0 and error is None:
        try:
            total = sum(state[n].numel() for n in names) * item_size
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
            for file, name in copied:
                shutil.copyfile(file, os.path.join(tmp, name))
            write_tokenizer_config(tmp, config, eos_token)
            with_user_permissions(tmp)
            _swap_into_place(tmp, out_dir)
            tmp = None
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
    if rank == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ExportFailed(f"export to {out_dir!r} failed, nothing was replaced: {error}")


def write_tokenizer_config(folder: str, config: dict, eos_token: str | None) -> None:
    """A bare tokenizer.json (prepare_data.py's tokenizer) does not say which class reads it nor
    which token ends a text: add tokenizer_config.json and generation_config.json where missing."""
    files = set(os.listdir(folder))
    if "tokenizer.json" in files and "tokenizer_config.json" not in files:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                       **({"eos_token": eos_token} if eos_token else {}),
                       "model_max_length": config["max_position_embeddings"]}, f, indent=2)
    if "generation_config.json" not in files and "eos_token_id" in config:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump({k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                       if k in config}, f, indent=2)


def with_user_permissions(folder: str) -> None:
    """mkdtemp makes a folder only its owner can read (0700): give the export the permissions
    the umask gives any new folder and file, so others on a shared cluster can read it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _swap_into_place(tmp: str, out_dir: str) -> None:
    """Rename the finished temporary folder to out_dir; a previous out_dir is moved aside first
    and deleted only once the new one is in place (a crash in between leaves it beside)."""
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-",
                               dir=os.path.dirname(out_dir))
        os.rmdir(old)
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.rename(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
