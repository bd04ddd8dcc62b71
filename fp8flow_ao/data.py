"""Offline training data: a real English corpus and a byte-level BPE tokenizer, built locally.

Nothing here touches the network. The corpus is prose that ships with every Python install:

* the Python language reference topics of ``pydoc_data.topics`` (the text of ``help("...")``), and
* the docstrings of the standard library's modules, classes and functions, read with :mod:`ast` from
  the source files (no module is imported, so nothing runs), tests and demos left out.

That is about 2 MB of English (a little more or less with the Python version), deterministic for a
given install, built in about 5 s. The tokenizer is a byte-level BPE with :data:`VOCAB_SIZE` entries
(the vocabulary of torchtitan's DeepSeek-V3 ``debugmodel``), so every byte string encodes with no
unknown token. A tokenizer trained on Python 3.11's corpus ships with the package
(:data:`PACKAGED_TOKENIZER_DIR`, 120 kB) so that every machine tokenizes the same way and torchtitan
TOML files can name a fixed path; :func:`build_assets` rebuilds everything into any directory.

Files (one directory, ``~/.cache/fp8flow_ao/assets`` by default, ``$FP8FLOW_ASSETS`` overrides it):
``corpus.jsonl`` (one ``{"text": ...}`` per document), ``tokenizer.json`` and
``tokenizer_config.json`` (the two files torchtitan's ``HuggingFaceTokenizer`` reads).
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 2048  # torchtitan deepseek_v3 "debugmodel" vocab_size
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
CORPUS_FILE = "corpus.jsonl"
PACKAGED_TOKENIZER_DIR = Path(__file__).parent / "torchtitan" / "assets" / "tokenizer"
# Docstrings shorter than this are mostly one-line stubs ("Return self.") that teach the model little.
MIN_DOCSTRING_CHARS = 60
# Standard-library folders that hold tests, demos, bundled packages or vendored code rather than docs.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "ensurepip",
        "__pycache__",
    }
)


def default_assets_dir() -> Path:
    """Where assets are built on first use: ``$FP8FLOW_ASSETS`` or ``~/.cache/fp8flow_ao/assets``."""
    env = os.environ.get("FP8FLOW_ASSETS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp8flow_ao" / "assets"


def _module_docstrings(path: Path) -> str:
    """All docstrings (module, classes, functions) of one source file, in source order."""
    try:
        with tokenize.open(path) as f:  # honours the file's coding cookie
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""  # a few stdlib files are templates or Python 2 fixtures
    nodes = (
        n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    )
    docs = (ast.get_docstring(n) for n in nodes)
    return "\n\n".join(d for d in docs if d and len(d) >= MIN_DOCSTRING_CHARS)


def iter_corpus_documents() -> Iterator[str]:
    """The corpus, one document at a time, in a fixed order (language reference, then stdlib files)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package pydoc_data separately; the docstrings remain
        topics = {}
    for name in sorted(topics):
        yield topics[name].strip()
    for path in _stdlib_sources():
        if text := _module_docstrings(path):
            yield text


def _stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path, skipped folders pruned (not walked)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        found += [Path(root, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(stdlib).as_posix())


def build_corpus(path: Path) -> Path:
    """Write the corpus as JSON lines (``{"text": ...}``) to ``path`` atomically; return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for doc in iter_corpus_documents():
            f.write(json.dumps({"text": doc}) + "\n")
    tmp.replace(path)  # readers never see a half-written file
    return path


def read_corpus(path: Path) -> list[str]:
    """The documents of a JSON-lines corpus file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def train_tokenizer(corpus: Path, out_dir: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train a byte-level BPE on ``corpus``; write ``tokenizer.json`` + ``tokenizer_config.json`` to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens, ever
        show_progress=False,
    )
    tok.train_from_iterator(read_corpus(corpus), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    # torchtitan's HuggingFaceTokenizer finds BOS/EOS here; its text dataset asks for both explicitly.
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": False, "add_eos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


@dataclass(frozen=True)
class Assets:
    """Paths of one assets directory."""

    corpus: Path
    tokenizer_dir: Path


def ensure_corpus(directory: Path | None = None) -> Path:
    """The corpus file under ``directory`` (default :func:`default_assets_dir`), built if missing."""
    path = Path(directory or default_assets_dir()) / CORPUS_FILE
    return path if path.exists() else build_corpus(path)


def build_assets(directory: Path, vocab_size: int = VOCAB_SIZE, force: bool = False) -> Assets:
    """Build ``corpus.jsonl`` and train ``tokenizer.json`` (+ ``tokenizer_config.json``) in ``directory``.

    Files already there are kept unless ``force``.
    """
    directory = Path(directory)
    if force:
        for name in (CORPUS_FILE, "tokenizer.json", "tokenizer_config.json"):
            (directory / name).unlink(missing_ok=True)
    corpus = ensure_corpus(directory)
    if not (directory / "tokenizer.json").exists():
        train_tokenizer(corpus, directory, vocab_size)
    return Assets(corpus, directory)


def load_tokenizer(tokenizer_dir: Path = PACKAGED_TOKENIZER_DIR):
    """The ``tokenizers.Tokenizer`` saved in ``tokenizer_dir`` (default: the packaged one)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


def tokenize_corpus(corpus: Path, tokenizer_dir: Path = PACKAGED_TOKENIZER_DIR) -> torch.Tensor:
    """The whole corpus as one int64 token stream, each document as ``BOS text EOS``."""
    tok = load_tokenizer(tokenizer_dir)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(read_corpus(corpus)):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.int64)


class TokenBatches:
    """Random windows of a token stream as (inputs, labels) batches, reproducible from a seed.

    The last ``holdout`` fraction of the stream is kept apart for :meth:`eval_batches`, so the
    evaluation text is never trained on.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, holdout: float = 0.05):
        split = int(tokens.numel() * (1 - holdout))
        if min(split, tokens.numel() - split) <= seq_len + 1:
            raise ValueError(f"tokens: {tokens.numel()} tokens are too few for seq_len={seq_len}, holdout={holdout}")
        self.train, self.held_out = tokens[:split], tokens[split:]
        self.batch_size, self.seq_len = batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def _windows(self, stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([stream[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next training batch: ``batch_size`` random windows of ``seq_len`` tokens (+1 for labels)."""
        high = self.train.numel() - self.seq_len - 1
        return self._windows(self.train, torch.randint(0, high, (self.batch_size,), generator=self.generator))

    def eval_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` fixed batches of consecutive windows from the held-out text."""
        n = self.batch_size * count
        starts = torch.arange(n) * (self.held_out.numel() - self.seq_len - 1) // n  # spread evenly, all in range
        return [self._windows(self.held_out, chunk) for chunk in starts.split(self.batch_size)]
