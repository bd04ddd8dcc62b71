"""The offline text datasets of fp8flow_ao in torchtitan's dataset table; nothing is downloaded.

* ``"fp8flow_offline"``: the small corpus of :mod:`fp8flow_ao.data` (Python's language reference and
  standard-library docstrings, ~650 K tokens) for debug runs. ``dataset_path`` may name a directory
  (its ``corpus.jsonl`` is built there if missing) or an existing JSON-lines file of ``{"text": ...}``
  records; unset, the default assets directory is used.
* ``"fp8flow_pysrc"`` and ``"fp8flow_pysrc_heldout"``: the training and held-out splits of the large
  source corpus of :mod:`fp8flow_ao.corpus` (~25 M tokens of installed Python sources) for long runs,
  e.g. ``training.dataset = "fp8flow_pysrc"`` with ``validation.dataset = "fp8flow_pysrc_heldout"``.
  ``dataset_path`` may name the corpus directory (built there with the default
  :class:`~fp8flow_ao.corpus.CorpusSpec` if missing) or one split's ``.jsonl`` file; unset,
  :func:`~fp8flow_ao.corpus.default_source_corpus_dir`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fp8flow_ao.data import default_assets_dir, ensure_corpus, read_corpus

DATASET_NAME = "fp8flow_offline"
SOURCE_DATASETS = {"fp8flow_pysrc": "train", "fp8flow_pysrc_heldout": "heldout"}


def load_offline_corpus(path: str):
    """A ``datasets.Dataset`` of the corpus at ``path`` (a directory or a ``.jsonl`` file)."""
    p = Path(path).expanduser()
    corpus = p if p.suffix == ".jsonl" else ensure_corpus(p)
    if not corpus.exists():
        raise FileNotFoundError(f"training.dataset_path: no corpus file at {corpus}")
    return _in_memory(corpus)


def _in_memory(corpus: Path):
    """A ``datasets.Dataset`` of a JSON-lines file, in memory: nothing cached to disk or looked up on the Hub."""
    from datasets import Dataset

    return Dataset.from_list([{"text": t} for t in read_corpus(corpus)])


def load_source_split(path: str, split: str):
    """A ``datasets.Dataset`` of one split of the source corpus at ``path`` (its directory or a ``.jsonl`` file)."""
    from fp8flow_ao.corpus import SPLITS, ensure_source_corpus

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    p = Path(path).expanduser()
    if p.suffix == ".jsonl":
        if not p.exists():
            raise FileNotFoundError(f"dataset_path: no corpus file at {p}")
        return _in_memory(p)
    corpus = ensure_source_corpus(p)
    return _in_memory(getattr(corpus, split))


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_dataset() -> None:
    """Add ``"fp8flow_offline"``, ``"fp8flow_pysrc"`` and ``"fp8flow_pysrc_heldout"`` to torchtitan's ``DATASETS`` (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from fp8flow_ao.corpus import default_source_corpus_dir

    DATASETS.setdefault(
        DATASET_NAME, DatasetConfig(path=str(default_assets_dir()), loader=load_offline_corpus, sample_processor=_text)
    )
    for name, split in SOURCE_DATASETS.items():
        loader = functools.partial(load_source_split, split=split)
        DATASETS.setdefault(
            name, DatasetConfig(path=str(default_source_corpus_dir()), loader=loader, sample_processor=_text)
        )
