"""Turn a text file into a token file for the GPT example: `python jobs/make_tokens.py INPUT.txt OUTPUT.bin`.

    python jobs/make_tokens.py notes.txt runs/data/notes.bin        # any text (or binary) file
    python jobs/make_tokens.py --from-stdlib runs/data/stdlib.bin   # a corpus from the installed stdlib

Tokens are bytes (vocab 256: no tokenizer to download), stored as a flat numpy array that
`np.memmap(OUTPUT.bin, dtype)` reads, with a sidecar `OUTPUT.json`: vocab_size, dtype, num_tokens,
source and the sha256 of the source bytes. Both files are written atomically (temporary file, then
rename; the sidecar first), so ranks that create the same file at once never see a partial one.
`--from-stdlib` concatenates the source of a fixed list of Python standard library modules (PSF
licence); the same Python version gives the same bytes. No torch import: this runs anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mgpu.fsutil import write_atomic  # noqa: E402

STDLIB_MODULES = ("textwrap", "argparse", "json.decoder", "pathlib", "functools", "dataclasses", "enum", "logging")
VOCABS = {"byte": 256}


class TokenError(Exception):
    """Bad input: the message is one line."""


def stdlib_corpus() -> bytes:
    """The source of `STDLIB_MODULES`, each under a `# ---- module ----` header, as UTF-8."""
    parts = []
    for name in STDLIB_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        parts.append(f"# ---- {name} ----\n{source}\n")
    return "".join(parts).encode("utf-8")


def sidecar_path(output: str | Path) -> Path:
    return Path(output).with_suffix(".json")


def write_tokens(data: bytes, output: str | Path, source: str, vocab: str = "byte") -> dict:
    """Encode `data` and write OUTPUT and its sidecar; returns the sidecar's fields."""
    if not data:
        raise TokenError(f"input '{source}' is empty: nothing to tokenize")
    if Path(output).suffix == ".json":
        raise TokenError(f"output '{output}' ends in .json, the sidecar's name: use e.g. OUTPUT.bin")
    vocab_size = VOCABS[vocab]
    dtype = np.uint8 if vocab_size <= 256 else np.uint16
    tokens = np.frombuffer(data, dtype=np.uint8).astype(dtype)
    meta = {"vocab_size": vocab_size, "dtype": np.dtype(dtype).name, "num_tokens": int(tokens.size),
            "vocab": vocab, "source": source, "source_sha256": hashlib.sha256(data).hexdigest()}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    # Sidecar first: whoever sees OUTPUT also finds its sidecar.
    write_atomic(sidecar_path(output), (json.dumps(meta, indent=2) + "\n").encode())
    write_atomic(output, tokens.tobytes())
    return meta


def encode_file(input_path: str | Path, output: str | Path, vocab: str = "byte") -> dict:
    path = Path(input_path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TokenError(f"input file '{path}' not found") from None
    except OSError as error:
        raise TokenError(f"input file '{path}' cannot be read: {error.strerror or error}") from None
    return write_tokens(data, output, str(path), vocab)


def make_stdlib_tokens(output: str | Path) -> dict:
    source = f"python {platform.python_version()} stdlib: {', '.join(STDLIB_MODULES)}"
    return write_tokens(stdlib_corpus(), output, source)


def read_meta(path: str | Path) -> dict:
    """The sidecar of token file `path`; TokenError if either file is missing or they disagree."""
    path = Path(path)
    if not path.is_file():
        raise TokenError(f"token file '{path}' not found: make it with `python jobs/make_tokens.py INPUT.txt {path}`")
    try:
        meta = json.loads(sidecar_path(path).read_text())
    except (OSError, ValueError) as error:
        raise TokenError(f"token file '{path}': sidecar {sidecar_path(path)} unreadable ({error}); "
                         "make both again with jobs/make_tokens.py") from None
    if path.stat().st_size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize:
        raise TokenError(f"token file '{path}' does not match its sidecar's num_tokens; make it again")
    return meta


def write_shards(path: str | Path, out_dir: str | Path, shards: int, block_size: int, windows: int) -> list[Path]:
    """Cut the first `windows` windows of `block_size + 1` tokens of token file `path` into `shards` token files
    (OUT_DIR/shard-000.bin, ... with sidecars), each a whole number of windows: read as windows of the same
    size (mgpu.data.stream.TokenWindows), the shards hold exactly the windows the map-style dataset indexes.
    Files already there with the same source and range are kept (ranks that do it at once are safe)."""
    meta = read_meta(path)
    if not 1 <= shards <= windows:
        raise TokenError(f"{shards} shards of {windows} windows: use 1 to {windows} shards")
    tokens = np.memmap(path, dtype=meta["dtype"], mode="r")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bounds = [windows * k // shards for k in range(shards + 1)]
    written = []
    for k in range(shards):
        first, last = bounds[k], bounds[k + 1]
        shard = out / f"shard-{k:03d}.bin"
        source = f"{meta['source_sha256']}[windows {first}:{last} of {block_size}]"
        try:
            if json.loads(sidecar_path(shard).read_text())["source"] == source and shard.is_file():
                written.append(shard)
                continue
        except (OSError, ValueError, KeyError):
            pass
        piece = np.asarray(tokens[first * block_size:last * block_size + 1])
        fields = {**meta, "num_tokens": int(piece.size), "source": source}
        write_atomic(sidecar_path(shard), (json.dumps(fields, indent=2) + "\n").encode())
        write_atomic(shard, piece.tobytes())
        written.append(shard)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--vocab byte] INPUT.txt OUTPUT.bin | --from-stdlib OUTPUT.bin")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="the text to tokenize and the token file to write (with --from-stdlib: OUTPUT.bin only)")
    parser.add_argument("--vocab", choices=sorted(VOCABS), default="byte", help="tokenization (default: byte)")
    parser.add_argument("--from-stdlib", action="store_true",
                        help=f"tokenize the source of {', '.join(STDLIB_MODULES)} instead of INPUT.txt")
    args = parser.parse_args(argv)
    expected = 1 if args.from_stdlib else 2
    if len(args.paths) != expected:
        parser.error("expected OUTPUT.bin" if args.from_stdlib else "expected INPUT.txt OUTPUT.bin")
    try:
        if args.from_stdlib:
            meta = make_stdlib_tokens(args.paths[0])
        else:
            meta = encode_file(args.paths[0], args.paths[1], args.vocab)
    except TokenError as error:
        print(f"make_tokens: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return 2
    print(f"{args.paths[-1]}: {meta['num_tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab_size']}) "
          f"from {meta['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
