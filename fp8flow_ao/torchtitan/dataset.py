"""The offline text dataset ``"fp8flow_offline"`` in torchtitan's dataset table.

``training.dataset = "fp8flow_offline"`` trains on the corpus of :mod:`fp8flow_ao.data` (Python's
language reference and standard-library docstrings), built on first use; nothing is downloaded.
``training.dataset_path`` may name a directory (its ``corpus.jsonl`` is built there if missing) or an
existing JSON-lines file of ``{"text": ...}`` records; unset, the default assets directory is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8flow_ao.data import default_assets_dir, ensure_corpus, read_corpus

DATASET_NAME = "fp8flow_offline"


def load_offline_corpus(path: str):
    """A ``datasets.Dataset`` of the corpus at ``path`` (a directory or a ``.jsonl`` file)."""
    from datasets import Dataset

    p = Path(path).expanduser()
    corpus = p if p.suffix == ".jsonl" else ensure_corpus(p)
    if not corpus.exists():
        raise FileNotFoundError(f"training.dataset_path: no corpus file at {corpus}")
    # In memory, so datasets neither caches to disk nor looks anything up on the Hub.
    return Dataset.from_list([{"text": t} for t in read_corpus(corpus)])


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_dataset() -> None:
    """Add ``"fp8flow_offline"`` to torchtitan's ``DATASETS`` (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS.setdefault(
        DATASET_NAME, DatasetConfig(path=str(default_assets_dir()), loader=load_offline_corpus, sample_processor=_text)
    )
