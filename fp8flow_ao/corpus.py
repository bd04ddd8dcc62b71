"""A large offline corpus for long training runs: the Python source files installed on this machine.

:mod:`fp8flow_ao.data`'s corpus (about 650 k tokens of standard-library docstrings) is enough for a
demo, but a 2000-step run of the ``fp8flow_gpu`` flavor (16 K tokens a step, 33 M tokens) would go
through it fifty times and measure memorization. This corpus is built from text every Python
install has, still downloaded from nowhere:

* the language-reference topics of ``pydoc_data.topics`` (the text of ``help("...")``), and
* every ``.py`` file of the standard library and of the ``site-packages`` folders (code, comments
  and docstrings as written), minus files that look generated (over :attr:`CorpusSpec.max_file_bytes`
  or with a line over :attr:`CorpusSpec.max_line_chars`) or too short to be a document.

How it is built (:func:`build_source_corpus`):

1. **Candidates**: the source roots are walked in sorted order; every document gets a *key* that
   does not depend on where the install lives (``stdlib/json/decoder.py``,
   ``site-packages/torch/nn/modules/linear.py``, ``pydoc/topics/assert``).
2. **Order**: candidates are visited in the order of ``sha256(key)``, a fixed pseudo-random mix, so
   the corpus interleaves packages (torchtitan reads its dataset sequentially: a corpus sorted by
   path would train on all of numpy, then all of torch) and a token budget takes an unbiased sample.
3. **Split**: a document is held out when ``sha256(key) mod 1000 < heldout_permille``; held-out and
   training documents never share a file.
4. **De-duplication**: text is normalized (``\\r\\n`` to ``\\n``, trailing spaces dropped, outer
   blank lines stripped) and a document whose normalized text hashes like one already taken is
   dropped, so vendored copies appear once and never on both sides of the split.
5. **Budget**: documents are tokenized with the packaged tokenizer (in batches) and taken until the
   training split holds :attr:`CorpusSpec.train_tokens` tokens and the held-out split
   :attr:`CorpusSpec.heldout_tokens` (counts include each document's BOS and EOS, as torchtitan
   feeds them); too few sources raise ``ValueError``.

**Determinism is "same machine, same result"**: the set of installed files differs between
machines (Python version, packages), so two machines build different corpora, but one machine
builds the same bytes every time. Which files went in is recorded in ``manifest.json`` next to the
corpus (key, sha256 of the normalized text, split, tokens of every document; the roots; the Python
version; the settings; the tokenizer's hash), so a run can be traced to its exact data and two
machines' corpora can be compared. Identical installs give identical corpora, since keys and hashes
do not name absolute paths.

Files (``<assets>/pysrc`` by default, see :func:`default_source_corpus_dir`): ``train.jsonl`` and
``heldout.jsonl`` (one ``{"text": ...}`` per document, the format of torchtitan's text datasets) and
``manifest.json``. The first use builds them with a progress bar (about 1 M tokens/s of tokenization
on 2 CPU cores, ~30 s for the default size); later uses read the manifest and reuse them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import site
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8flow_ao.data import BOS, EOS, PACKAGED_TOKENIZER_DIR, default_assets_dir, load_tokenizer

MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "heldout")
# Bumped whenever the selection rules change, so an old cache is not mistaken for a new build.
BUILDER_VERSION = 1
# Folders that hold no source text (bytecode caches) or only copies of another install's files.
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
# Documents tokenized per encode_batch call: large enough for the tokenizer's thread pool to pay,
# small enough that the budget is not overshot by much and the progress bar moves.
_BATCH = 64


@dataclass(frozen=True)
class CorpusSpec:
    """How big the source corpus is and which files qualify.

    The defaults size it for the ``fp8flow_gpu`` convergence run: 2000 steps of 8 x 2048 tokens are
    32.8 M tokens, 1.37 passes over 24 M training tokens (any run up to 2929 steps stays within two).
    """

    train_tokens: int = 24_000_000
    """Tokens (BOS and EOS included) the training split must reach."""
    heldout_tokens: int = 1_000_000
    """Tokens the held-out split must reach (16 validation steps of 8 x 2048 tokens use 262 K)."""
    heldout_permille: int = 20
    """Documents held out per thousand (by the hash of their key); the rest may train."""
    min_chars: int = 200
    """Shorter documents (empty ``__init__.py``, one-line stubs) are left out."""
    max_file_bytes: int = 1_000_000
    """Larger files are mostly generated tables, not text written by people."""
    max_line_chars: int = 1000
    """A file with a longer line is data (embedded blobs, minified tables), not source text."""

    def __post_init__(self) -> None:
        for name in ("train_tokens", "heldout_tokens", "min_chars", "max_file_bytes", "max_line_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"CorpusSpec.{name} must be a positive int, got {value!r}")
        if not 0 < self.heldout_permille < 1000:
            raise ValueError(f"CorpusSpec.heldout_permille must be in 1..999, got {self.heldout_permille!r}")


@dataclass(frozen=True)
class SourceCorpus:
    """A built source corpus: its two JSON-lines files and its manifest."""

    directory: Path
    manifest: dict[str, Any]

    @property
    def train(self) -> Path:
        """``train.jsonl``."""
        return self.directory / "train.jsonl"

    @property
    def heldout(self) -> Path:
        """``heldout.jsonl``."""
        return self.directory / "heldout.jsonl"

    def tokens(self, split: str) -> int:
        """Tokens of ``split`` (``"train"`` or ``"heldout"``), BOS and EOS included."""
        return self.manifest["counts"][split]["tokens"]


def default_source_corpus_dir() -> Path:
    """``pysrc`` under :func:`fp8flow_ao.data.default_assets_dir` (``$FP8FLOW_ASSETS`` or ``~/.cache/...``)."""
    return default_assets_dir() / "pysrc"


def default_roots() -> dict[str, Path]:
    """Source roots of this interpreter: ``stdlib`` and each existing site-packages folder, by label."""
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    site_dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    unique = sorted({os.path.realpath(p) for p in site_dirs if os.path.isdir(p)})
    for i, path in enumerate(unique):
        roots["site-packages" if i == 0 else f"site-packages-{i}"] = Path(path)
    return roots


def _walk_sources(label: str, root: Path) -> Iterator[tuple[str, Path]]:
    """``(key, path)`` of every ``.py`` file under ``root``, sorted; nested site-packages pruned."""
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        rel = Path(dirpath).relative_to(root).as_posix()
        for name in sorted(f for f in files if f.endswith(".py")):
            yield (f"{label}/{name}" if rel == "." else f"{label}/{rel}/{name}"), Path(dirpath, name)


def candidate_keys(roots: dict[str, Path], with_pydoc: bool = True) -> dict[str, Path | str]:
    """Every candidate document: key -> source file, or key -> text for the pydoc topics."""
    found: dict[str, Path | str] = {}
    if with_pydoc:
        try:
            from pydoc_data.topics import topics
        except ImportError:  # some distributions package pydoc_data separately; the sources remain
            topics = {}
        found.update({f"pydoc/topics/{name}": topics[name] for name in sorted(topics)})
    for label in sorted(roots):
        found.update(_walk_sources(label, roots[label]))
    return found


def key_hash(key: str) -> int:
    """The stable 64-bit hash of a document key that orders the corpus and picks the held-out split."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def normalize(text: str) -> str:
    """Line endings to ``\\n``, trailing whitespace of each line dropped, outer blank lines stripped."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")).strip("\n")


def _read(source: Path | str, spec: CorpusSpec) -> str | None:
    """The normalized text of a candidate, or None when it does not qualify (size, data-like, not UTF-8)."""
    if isinstance(source, str):
        text = source
    else:
        try:
            if source.stat().st_size > spec.max_file_bytes:
                return None
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # unreadable or another encoding: not part of the corpus
            return None
    text = normalize(text)
    if len(text) < spec.min_chars or max(map(len, text.split("\n"))) > spec.max_line_chars:
        return None
    return text


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="doc", file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class _Writer:
    """Appends documents to both split files and counts them, until each split's budget is met."""

    def __init__(self, directory: Path, spec: CorpusSpec):
        self.budget = {"train": spec.train_tokens, "heldout": spec.heldout_tokens}
        self.counts = {s: {"documents": 0, "tokens": 0, "chars": 0} for s in SPLITS}
        self.files = {s: (directory / f"{s}.jsonl.tmp").open("w", encoding="utf-8") for s in SPLITS}
        self.documents: list[dict[str, Any]] = []

    def full(self, split: str) -> bool:
        return self.counts[split]["tokens"] >= self.budget[split]

    def done(self) -> bool:
        return all(map(self.full, SPLITS))

    def add(self, key: str, split: str, text: str, sha: str, tokens: int) -> None:
        self.files[split].write(json.dumps({"text": text}) + "\n")
        count = self.counts[split]
        count["documents"] += 1
        count["tokens"] += tokens
        count["chars"] += len(text)
        self.documents.append({"key": key, "sha256": sha, "split": split, "tokens": tokens})

    def close(self, directory: Path) -> None:
        for split, f in self.files.items():
            f.close()
            (directory / f"{split}.jsonl.tmp").replace(directory / f"{split}.jsonl")


def _select(
    candidates: dict[str, Path | str], spec: CorpusSpec, writer: _Writer, tokenizer_dir: Path
) -> dict[str, int]:
    """Visit candidates in key-hash order, filter, de-duplicate, tokenize and write until both budgets are met."""
    tok = load_tokenizer(tokenizer_dir)
    special = len(tok.encode(BOS + EOS).ids)  # the two ids torchtitan adds around each document
    order = sorted(candidates, key=lambda k: (key_hash(k), k))
    seen: set[str] = set()
    stats = {"candidates": len(order), "visited": 0, "skipped": 0, "duplicates": 0, "over_budget": 0}
    bar = _progress(len(order), "source corpus")
    try:
        for chunk in _chunks(order, _BATCH):
            if writer.done():
                break
            kept = []
            for key in chunk:
                stats["visited"] += 1
                split = "heldout" if key_hash(key) % 1000 < spec.heldout_permille else "train"
                if writer.full(split):
                    stats["over_budget"] += 1
                    continue
                text = _read(candidates[key], spec)
                if text is None:
                    stats["skipped"] += 1
                    continue
                sha = hashlib.sha256(text.encode()).hexdigest()
                if sha in seen:
                    stats["duplicates"] += 1
                    continue
                seen.add(sha)
                kept.append((key, split, text, sha))
            for (key, split, text, sha), enc in zip(kept, tok.encode_batch([k[2] for k in kept]), strict=True):
                writer.add(key, split, text, sha, len(enc.ids) + special)
            bar.update(len(chunk))
            bar.set_postfix(train=f"{writer.counts['train']['tokens'] / 1e6:.1f}M", refresh=False)
    finally:
        bar.close()
    return stats


def build_source_corpus(
    directory: Path,
    spec: CorpusSpec = CorpusSpec(),
    roots: dict[str, Path] | None = None,
    with_pydoc: bool = True,
    tokenizer_dir: Path = PACKAGED_TOKENIZER_DIR,
) -> SourceCorpus:
    """Build ``train.jsonl``, ``heldout.jsonl`` and ``manifest.json`` in ``directory`` (see the module doc).

    ``roots`` maps a label to a folder of ``.py`` files (default :func:`default_roots`). Raises
    ``ValueError`` when the sources hold fewer tokens than ``spec`` asks for. Files appear only when
    complete (written under a temporary name, then renamed; the manifest last).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    roots = default_roots() if roots is None else {k: Path(v) for k, v in roots.items()}
    candidates = candidate_keys(roots, with_pydoc)
    writer = _Writer(directory, spec)
    try:
        stats = _select(candidates, spec, writer, tokenizer_dir)
    finally:
        writer.close(directory)
    for split in SPLITS:
        if not writer.full(split):
            raise ValueError(
                f"CorpusSpec.{split}_tokens={writer.budget[split]:,}: the sources hold only "
                f"{writer.counts[split]['tokens']:,} {split} tokens ({len(candidates)} candidate documents "
                f"under {sorted(map(str, roots.values()))}); lower it or add roots"
            )
    manifest = {
        "builder_version": BUILDER_VERSION,
        "spec": dataclasses.asdict(spec),
        "python": platform.python_version(),
        "roots": {label: str(path) for label, path in sorted(roots.items())},
        "with_pydoc": with_pydoc,
        "tokenizer_sha256": _file_sha256(Path(tokenizer_dir) / "tokenizer.json"),
        "counts": writer.counts,
        "selection": stats,
        "documents": writer.documents,
    }
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=0) + "\n")
    tmp.replace(directory / MANIFEST_FILE)
    return SourceCorpus(directory, manifest)


def load_source_corpus(directory: Path) -> SourceCorpus:
    """The corpus built in ``directory``; ``FileNotFoundError`` when it has not been built."""
    path = Path(directory) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"no source corpus in {directory} (no {MANIFEST_FILE}); build_source_corpus makes one")
    return SourceCorpus(Path(directory), json.loads(path.read_text()))


def ensure_source_corpus(
    directory: Path | None = None, spec: CorpusSpec | None = None, tokenizer_dir: Path = PACKAGED_TOKENIZER_DIR
) -> SourceCorpus:
    """The corpus in ``directory`` (default :func:`default_source_corpus_dir`), built on first use.

    Without ``spec`` an existing build is taken as it is (its manifest says how it was made) and a
    missing one is built with the default :class:`CorpusSpec`. With ``spec`` an existing build is
    reused only if it was made with that spec, this builder version and this tokenizer; otherwise
    ``ValueError`` (delete the folder or name another one): a cache silently rebuilt to other
    settings would change a run's data without a trace.
    """
    directory = Path(directory or default_source_corpus_dir())
    if not (directory / MANIFEST_FILE).exists():
        print(f"fp8flow_ao: building the source corpus in {directory} (first use)", file=sys.stderr)
        return build_source_corpus(directory, spec or CorpusSpec(), tokenizer_dir=tokenizer_dir)
    corpus = load_source_corpus(directory)
    if spec is None:
        return corpus
    expected = {
        "builder_version": BUILDER_VERSION,
        "spec": dataclasses.asdict(spec),
        "tokenizer_sha256": _file_sha256(Path(tokenizer_dir) / "tokenizer.json"),
    }
    found = {k: corpus.manifest.get(k) for k in expected}
    if found != expected:
        raise ValueError(
            f"source corpus in {directory} was built with {found}, not {expected}: delete it or use another directory"
        )
    return corpus


def describe(corpus: SourceCorpus, tokens_per_step: int | None = None, steps: int | None = None) -> str:
    """One paragraph: documents and tokens per split and, given a run's size, the epochs it makes."""
    c = corpus.manifest["counts"]
    text = ", ".join(
        f"{s} {c[s]['documents']:,} documents / {c[s]['tokens'] / 1e6:.2f} M tokens / {c[s]['chars'] / 1e6:.1f} M chars"
        for s in SPLITS
    )
    text = f"source corpus {corpus.directory}: {text}"
    if tokens_per_step and steps:
        text += f"; {steps} steps x {tokens_per_step:,} tokens = {epochs(corpus, tokens_per_step, steps):.2f} epochs"
    return text


def epochs(corpus: SourceCorpus, tokens_per_step: int, steps: int) -> float:
    """Passes over the training split that ``steps`` steps of ``tokens_per_step`` tokens make."""
    return steps * tokens_per_step / corpus.tokens("train")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fp8flow_ao.corpus [DIR] [--train-tokens N]``: build (or reuse) and describe the corpus."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fp8flow_ao.corpus", description=main.__doc__)
    p.add_argument("directory", nargs="?", type=Path, help="default: $FP8FLOW_ASSETS/pysrc or ~/.cache/...")
    p.add_argument("--train-tokens", type=int, default=CorpusSpec.train_tokens)
    p.add_argument("--heldout-tokens", type=int, default=CorpusSpec.heldout_tokens)
    p.add_argument("--tokens-per-step", type=int, default=8 * 2048, help="for the epochs line (fp8flow_gpu: 8 x 2048)")
    p.add_argument("--steps", type=int, default=2000, help="for the epochs line")
    args = p.parse_args(argv)
    spec = CorpusSpec(train_tokens=args.train_tokens, heldout_tokens=args.heldout_tokens)
    # An explicit spec: a cached build made with other settings is reported, not silently reused.
    print(describe(ensure_source_corpus(args.directory, spec), args.tokens_per_step, args.steps))


if __name__ == "__main__":
    main()
