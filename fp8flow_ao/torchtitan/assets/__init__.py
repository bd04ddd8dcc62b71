"""Offline assets for torchtitan runs: the packaged tokenizer and a builder for corpus + tokenizer.

``tokenizer/`` holds ``tokenizer.json`` and ``tokenizer_config.json``: the byte-level BPE (2048
tokens) that ``python -m fp8flow_ao.torchtitan.assets OUTDIR`` trained on Python 3.11.7's corpus,
so TOML configs can name ``model.hf_assets_path = "fp8flow_ao/torchtitan/assets/tokenizer"`` and
every machine tokenizes alike. The corpus itself (about 2 MB) is not shipped: it is rebuilt from the
local Python install on first use.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fp8flow_ao.data import PACKAGED_TOKENIZER_DIR, VOCAB_SIZE, build_assets, read_corpus

TOKENIZER_DIR = PACKAGED_TOKENIZER_DIR


def main(argv: list[str] | None = None) -> None:
    """``python -m fp8flow_ao.torchtitan.assets OUTDIR``: build the offline corpus and tokenizer, print where."""
    parser = argparse.ArgumentParser(
        prog="python -m fp8flow_ao.torchtitan.assets",
        description="Build the offline corpus (corpus.jsonl) and a byte-level BPE tokenizer in OUTDIR; no network.",
    )
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--force", action="store_true", help="rebuild files that already exist")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    assets = build_assets(args.outdir, args.vocab_size, args.force)
    docs = read_corpus(assets.corpus)
    print(
        f"corpus: {assets.corpus} ({len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} M characters)\n"
        f"tokenizer: {assets.tokenizer_dir / 'tokenizer.json'} (vocab {args.vocab_size})\n"
        f"built in {time.perf_counter() - start:.1f} s"
    )
