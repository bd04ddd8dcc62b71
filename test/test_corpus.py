"""The large source corpus (fp8flow_ao.corpus) on a small slice: determinism, split, counts, reuse.

The slice is the standard library's ``email`` package plus a folder of hand-made files (a duplicate
with other line endings, a data-like file, a stub), with budgets of a few thousand tokens, so each
build takes well under a second.
"""

from __future__ import annotations

import dataclasses
import email
import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

from fp8flow_ao import corpus as C  # noqa: E402
from fp8flow_ao.data import load_tokenizer, read_corpus  # noqa: E402

SPEC = C.CorpusSpec(train_tokens=30_000, heldout_tokens=4_000, heldout_permille=250)
PROSE = "The parser reads each header line and keeps the value as written, folding continuation lines. "


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    extra = tmp_path_factory.mktemp("extra")
    (extra / "original.py").write_text('"""' + PROSE * 8 + '"""\n\nx = 1\n')
    (extra / "copy_crlf.py").write_text('"""' + PROSE * 8 + '"""  \r\n\r\nx = 1\r\n\r\n')  # same after normalize
    (extra / "table.py").write_text("DATA = " + repr(list(range(2000))) + "\n" + PROSE * 4)  # one 10 K-char line
    (extra / "stub.py").write_text("pass\n")
    return {"stdlib": Path(email.__file__).parent, "extra": extra}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, roots: dict[str, Path]) -> C.SourceCorpus:
    return C.build_source_corpus(tmp_path_factory.mktemp("a"), SPEC, roots, with_pydoc=False)


def by_split(c: C.SourceCorpus, split: str) -> list[dict]:
    return [d for d in c.manifest["documents"] if d["split"] == split]


def test_same_sources_build_the_same_bytes(tmp_path: Path, built: C.SourceCorpus, roots: dict) -> None:
    again = C.build_source_corpus(tmp_path, SPEC, roots, with_pydoc=False)
    for split in C.SPLITS:
        assert getattr(again, split).read_bytes() == getattr(built, split).read_bytes()
    assert again.manifest == built.manifest
    keys = [d["key"] for d in built.manifest["documents"]]
    assert all(k.startswith(("stdlib/", "extra/")) and "/tmp" not in k for k in keys), "keys name no machine path"
    assert keys == sorted(keys, key=lambda k: (C.key_hash(k), k)), "documents in key-hash order, not by path"


def test_heldout_shares_no_file_and_no_text_with_training(built: C.SourceCorpus) -> None:
    train, held = by_split(built, "train"), by_split(built, "heldout")
    assert train and held
    assert not {d["key"] for d in train} & {d["key"] for d in held}
    assert not {d["sha256"] for d in train} & {d["sha256"] for d in held}
    assert all(C.key_hash(d["key"]) % 1000 < SPEC.heldout_permille for d in held)
    assert all(C.key_hash(d["key"]) % 1000 >= SPEC.heldout_permille for d in train)
    assert not set(read_corpus(built.train)) & set(read_corpus(built.heldout))


def test_reported_counts_are_the_tokens_torchtitan_sees(built: C.SourceCorpus) -> None:
    tok = load_tokenizer()
    for split in C.SPLITS:
        texts = read_corpus(getattr(built, split))
        tokens = [len(e.ids) + 2 for e in tok.encode_batch(texts)]  # + BOS and EOS, as torchtitan adds them
        counts = built.manifest["counts"][split]
        assert counts == {"documents": len(texts), "tokens": sum(tokens), "chars": sum(map(len, texts))}
        assert [d["tokens"] for d in by_split(built, split)] == tokens
        assert built.tokens(split) >= getattr(SPEC, f"{split}_tokens")
    assert built.tokens("train") < SPEC.train_tokens + 64 * 20_000, "the budget stops the build"
    assert C.epochs(built, 1000, 30) == pytest.approx(30_000 / built.tokens("train"))
    assert "train" in C.describe(built, 1000, 30) and "epochs" in C.describe(built, 1000, 30)


def test_duplicates_data_files_and_stubs_are_left_out(tmp_path: Path, roots: dict) -> None:
    spec = dataclasses.replace(SPEC, train_tokens=1, heldout_tokens=1, heldout_permille=1)
    only_extra = {"extra": roots["extra"]}
    # heldout_permille=1: every file trains unless its key hashes into the 1/1000 held-out slice.
    with pytest.raises(ValueError, match="heldout_tokens"):
        C.build_source_corpus(tmp_path, spec, only_extra, with_pydoc=False)
    manifest_docs = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(manifest_docs) == 1, "the CRLF copy is a duplicate; the table and the stub do not qualify"
    assert manifest_docs[0]["text"] == C.normalize((roots["extra"] / "original.py").read_text())


def test_too_few_sources_raise_naming_the_setting(tmp_path: Path, roots: dict) -> None:
    with pytest.raises(ValueError, match=r"train_tokens=10,000,000.*lower it"):
        C.build_source_corpus(tmp_path, dataclasses.replace(SPEC, train_tokens=10_000_000), roots, with_pydoc=False)
    assert not (tmp_path / C.MANIFEST_FILE).exists(), "no manifest: a later use does not take a partial build"
    with pytest.raises(ValueError, match="heldout_permille"):
        C.CorpusSpec(heldout_permille=0)
    with pytest.raises(ValueError, match="train_tokens"):
        C.CorpusSpec(train_tokens=0)


def test_later_uses_reuse_the_build_and_refuse_other_settings(built: C.SourceCorpus) -> None:
    stamp = built.train.stat().st_mtime_ns
    again = C.ensure_source_corpus(built.directory, SPEC)
    assert again.manifest == built.manifest and built.train.stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="delete it or use another directory"):
        C.ensure_source_corpus(built.directory, dataclasses.replace(SPEC, train_tokens=SPEC.train_tokens + 1))
    with pytest.raises(FileNotFoundError, match="no source corpus"):
        C.load_source_corpus(built.directory / "missing")


def test_torchtitan_reads_both_splits(built: C.SourceCorpus) -> None:
    pytest.importorskip("torchtitan")
    pytest.importorskip("datasets")
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    import fp8flow_ao.torchtitan  # noqa: F401  (registers the datasets)
    from fp8flow_ao.torchtitan.assets import TOKENIZER_DIR

    tok = HuggingFaceTokenizer(str(TOKENIZER_DIR))
    first = {}
    for name, split in (("fp8flow_pysrc", "train"), ("fp8flow_pysrc_heldout", "heldout")):
        ds = HuggingFaceTextDataset(name, str(built.directory), tok, seq_len=32)
        inputs, _ = next(iter(ds))
        first[split] = inputs["input"].tolist()
        expected = tok.encode(read_corpus(getattr(built, split))[0], add_bos=True, add_eos=True)[:32]
        assert first[split] == expected
    assert first["train"] != first["heldout"]
