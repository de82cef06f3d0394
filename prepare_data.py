"""prepare_data.py - text or JSONL documents -> the token file train.py reads with --documents.

    python prepare_data.py --tokenizer path/to/model_dir --input docs.jsonl more/*.txt \
        --output data/train.bin
    python train.py --data data/train.bin --documents --model llama3-8b ...

Each document is tokenized with a Hugging Face tokenizer from a local directory (its
tokenizer.json, read by the `tokenizers` library: no hub, no network) and followed by the
separator token (default: the tokenizer's end-of-text token, e.g. Llama-3's <|end_of_text|>,
Qwen's <|endoftext|>; or --separator TOKEN / --separator-id ID). Written next to each other:

  train.bin        flat little-endian token ids, uint16 when the vocabulary fits, else uint32
  train.bin.docs   flat little-endian int64: where each document starts (data.py's index)
  train.bin.json   {"dtype", "vocab_size", "separator_id", "documents", "tokens", ...}

Inputs: .jsonl (one JSON object per line, the text under --text-key, default "text") and plain
text files (.txt and anything else): one document per file, or per non-empty line with
--txt-lines. Empty documents are skipped (counted in the summary).
"""

import argparse
import json
import os
import sys

import numpy as np
from tqdm import tqdm

from support.data import boundary_path, sidecar_path
from support import paths

# End-of-text tokens of common tokenizers, tried in this order when no separator is given.
KNOWN_SEPARATORS = ["<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>"]


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"no tokenizer.json at {path!r} "
                         "(give a local model directory or the file)")
    try:
        return Tokenizer.from_file(file)
    except Exception as error:  # the tokenizers library raises plain Exceptions
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"--tokenizer {file!r} is not a tokenizer.json the tokenizers library "
                         f"reads ({reason})") from None


def choose_separator(tokenizer, token: str | None, token_id: int | None) -> int:
    """The separator's id: --separator-id, --separator's id, or the first known end-of-text token
    the tokenizer has. ValueError naming what to pass otherwise."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if token_id is not None:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"--separator-id {token_id} is outside the tokenizer's vocabulary "
                             f"[0, {vocab_size})")
        return token_id
    for name in [token] if token is not None else KNOWN_SEPARATORS:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return found
    if token is not None:
        raise ValueError(f"--separator {token!r} is not a token of this tokenizer")
    raise ValueError(f"the tokenizer has none of the usual end-of-text tokens "
                     f"({', '.join(KNOWN_SEPARATORS)}): name one with --separator TOKEN or "
                     f"--separator-id ID")


def read_documents(paths, text_key: str = "text", txt_lines: bool = False):
    """Yield the text of every document in `paths`, in order."""
    for path in paths:
        try:
            yield from _documents_of(path, text_key, txt_lines)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text "
                             f"({error.reason} at byte {error.start})") from None


def _documents_of(path: str, text_key: str, txt_lines: bool):
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not JSON ({error})") from error
                if not isinstance(record, dict) or text_key not in record:
                    raise ValueError(f"{path}:{number}: no {text_key!r} field (--text-key)")
                if not isinstance(record[text_key], str):
                    raise ValueError(f"{path}:{number}: {text_key!r} is not text")
                yield record[text_key]
    else:
        with open(path, encoding="utf-8") as f:
            if txt_lines:
                yield from (line.rstrip("\n") for line in f if line.strip())
            else:
                yield f.read()


def check_outputs(outputs, inputs, tokenizer_path: str, overwrite: bool) -> None:
    """Refuse, before tokenizing, outputs that cannot be written as files or that would destroy
    something: an --input, a file of the tokenizer, an earlier output (unless overwrite)."""
    output = outputs[0]
    if not output.strip():
        raise ValueError("--output is empty: give the token file's path (e.g. data/train.bin)")
    if output.endswith(("/", os.sep)) or os.path.isdir(output):
        raise ValueError(f"--output {output!r} is a folder: --output is the token file's path, "
                         f"e.g. {os.path.join(output, 'train.bin')!r}")
    paths.check_can_write("--output", output)
    tokenizer_files = ([os.path.join(tokenizer_path, f) for f in os.listdir(tokenizer_path)]
                       if os.path.isdir(tokenizer_path) else [tokenizer_path])
    kept = {file_id(p): "one of the --input files" for p in inputs}
    kept.update({file_id(p): f"a file of the --tokenizer {tokenizer_path!r}"
                 for p in tokenizer_files if os.path.isfile(p) and not earlier_output(p)})
    for path in outputs:
        if os.path.isdir(path):
            raise ValueError(f"--output would write {path!r}, which is a folder: choose another "
                             f"--output")
        if os.path.exists(path) and file_id(path) in kept:
            raise ValueError(f"--output would write {path!r}, which is {kept[file_id(path)]}")
        if os.path.exists(path) and not overwrite:
            raise ValueError(f"{path!r} exists (an earlier run's output?): choose another "
                             f"--output, or --overwrite to replace it")


def earlier_output(path: str) -> bool:
    """Whether `path` is a token file this script wrote, or its index or sidecar (a token file
    with both beside it): in the tokenizer's folder such files are outputs, not the tokenizer."""
    bases = {path, path.removesuffix(".json"), path.removesuffix(".docs")}
    return any(os.path.isfile(base) and os.path.isfile(sidecar_path(base))
               and os.path.isfile(boundary_path(base)) for base in bases)


def file_id(path: str) -> tuple[int, int]:
    """The file itself (links and other names of it alike)."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def prepare(tokenizer_path, inputs, output, separator=None, separator_id=None, text_key="text",
            txt_lines=False, batch_size=256, progress=True, overwrite=False) -> dict:
    """Write the token file, its boundary index and its sidecar; return the summary. Refuses,
    before reading any document, to write over an input, the tokenizer or (unless overwrite) an
    earlier output (check_outputs)."""
    for path in inputs:
        if not os.path.exists(path):
            raise ValueError(f"--input {path!r} does not exist")
        if not os.path.isfile(path):
            raise ValueError(f"--input {path!r} is not a file (give the files inside a folder, "
                             f"e.g. {os.path.join(path, '*.txt')})")
    tokenizer = load_tokenizer(tokenizer_path)
    sep = choose_separator(tokenizer, separator, separator_id)
    outputs = [output, boundary_path(output), sidecar_path(output)]
    check_outputs(outputs, inputs, tokenizer_path, overwrite)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    lengths, skipped, n_tokens = [], 0, 0

    def write(texts, tokens_file, index_file):
        nonlocal skipped, n_tokens
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids = encoding.ids
            if not ids:
                skipped += 1
                continue
            np.array([n_tokens], dtype="<i8").tofile(index_file)
            np.asarray(ids + [sep], dtype=np_dtype).tofile(tokens_file)
            lengths.append(len(ids) + 1)
            n_tokens += len(ids) + 1

    # Written under temporary names and renamed into place only when all three are complete:
    # a run that fails half way (a bad file) leaves nothing behind, and an earlier output that
    # --overwrite would replace stays as it was.
    temporary = {path: f"{path}.partial-{os.getpid()}" for path in outputs}
    try:
        with open(temporary[output], "wb") as tokens_file, \
                open(temporary[boundary_path(output)], "wb") as index_file:
            texts = []
            bar = tqdm(read_documents(inputs, text_key, txt_lines), unit=" docs",
                       disable=not progress, desc="tokenizing")
            for text in bar:
                texts.append(text)
                if len(texts) == batch_size:
                    write(texts, tokens_file, index_file)
                    texts = []
                    bar.set_postfix(tokens=f"{n_tokens:,}")
            write(texts, tokens_file, index_file)
        if not lengths:
            raise ValueError(f"no documents with any tokens in {', '.join(inputs)}")
        info = {"dtype": dtype, "vocab_size": vocab_size, "separator_id": sep,
                "separator": tokenizer.id_to_token(sep), "documents": len(lengths),
                "tokens": n_tokens, "tokenizer": os.path.abspath(tokenizer_path),
                "inputs": [os.path.abspath(p) for p in inputs]}
        with open(temporary[sidecar_path(output)], "w") as f:
            json.dump(info, f, indent=1)
        for path in outputs:
            os.replace(temporary[path], path)
    finally:
        for path in temporary.values():
            if os.path.exists(path):
                os.remove(path)
    percentiles = np.percentile(lengths, [50, 90, 99]).round().astype(int).tolist()
    return {**info, "skipped_empty": skipped, "length_min": min(lengths),
            "length_p50": percentiles[0], "length_p90": percentiles[1],
            "length_p99": percentiles[2], "length_max": max(lengths)}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tokenize documents into a token file for "
                                                 "train.py --documents.")
    parser.add_argument("--tokenizer", required=True,
                        help="local model directory or tokenizer.json")
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl or text files")
    parser.add_argument("--output", required=True, help="the token file (e.g. data/train.bin)")
    parser.add_argument("--separator", default=None, help="separator token (default: end of text)")
    parser.add_argument("--separator-id", type=int, default=None, help="separator token id")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--txt-lines", action="store_true",
                        help="text files: one document per non-empty line (default: per file)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    opts = parser.parse_args(argv)
    try:
        summary = prepare(opts.tokenizer, opts.input, opts.output, opts.separator,
                          opts.separator_id, opts.text_key, opts.txt_lines,
                          progress=sys.stderr.isatty(), overwrite=opts.overwrite)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    s = summary
    print(f"{s['documents']:,} documents, {s['tokens']:,} tokens ({s['dtype']}, vocabulary "
          f"{s['vocab_size']:,}, separator {s['separator']!r} = {s['separator_id']}); "
          f"{s['skipped_empty']} empty skipped")
    print(f"document length in tokens (with the separator): min {s['length_min']:,}, "
          f"p50 {s['length_p50']:,}, p90 {s['length_p90']:,}, p99 {s['length_p99']:,}, "
          f"max {s['length_max']:,}")
    print(f"wrote {opts.output}, {boundary_path(opts.output)}, {sidecar_path(opts.output)}")


if __name__ == "__main__":
    main()
