"""Trains the offline tokenizer aiperf needs and lays it out as a HuggingFace cache entry.

aiperf 0.13.0 has no usable offline tokenizer here: ``--tokenizer builtin`` downloads
tiktoken's ``o200k_base`` on first use, and a local directory breaks its parallel decode
(its workers force ``HF_HUB_OFFLINE=1`` and call ``snapshot_download(<path>)``, which
rejects a path). A model id that is already in the HF cache works in both places, so this
script trains a byte-level BPE (vocabulary ``--vocab-size``, 4096) on the Shakespeare text
bundled with aiperf, saves it with ``PreTrainedTokenizerFast.save_pretrained`` and puts it
at ``HF_HOME/hub/models--local--quiesce-bpe/{refs/main,snapshots/<rev>/...}``, where
``<rev>`` is the SHA-1 of the saved files. aiperf then runs with ``HF_HOME=<that dir>
HF_HUB_OFFLINE=1 --tokenizer local/quiesce-bpe``.

Runs with the aiperf venv's python (it imports aiperf, tokenizers and transformers):

    .venv-aiperf/bin/python ci/aiperf_tokenizer.py --hf-home .cache/aiperf-hf

Takes a few seconds. Idempotent: does nothing when the entry is complete; a partial entry
is replaced (the snapshot is written to a temporary directory and renamed into place,
``refs/main`` last). Exits non-zero with the exception on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

MODEL_ID = "local/quiesce-bpe"
SPECIAL_TOKENS = ["<|endoftext|>"]


def corpus_path() -> Path:
    """aiperf's bundled Shakespeare text (the corpus of its synthetic prompts)."""
    import aiperf  # noqa: PLC0415 (after main() set HF_HOME)

    path = Path(aiperf.__file__).parent / "dataset" / "generator" / "assets" / "shakespeare.txt"
    if not path.is_file():
        raise FileNotFoundError(f"aiperf's corpus is not at {path}")
    return path


def train(corpus: Path, vocab_size: int, out_dir: Path) -> None:
    """Trains a byte-level BPE on ``corpus`` and saves it (HF format) into ``out_dir``."""
    from tokenizers import (  # noqa: PLC0415 (after main() set HF_HOME)
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        unk_token=SPECIAL_TOKENS[0],
    )
    fast.save_pretrained(str(out_dir))


def revision_of(directory: Path) -> str:
    """A 40-hex revision: SHA-1 over the saved files' names and contents."""
    digest = hashlib.sha1()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def install(hf_home: Path, vocab_size: int) -> Path:
    """Makes sure the cache entry exists; returns its snapshot directory."""
    repo = hf_home / "hub" / ("models--" + MODEL_ID.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if all((snapshot / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return snapshot
    (repo / "snapshots").mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=repo / "snapshots"))
    try:
        train(corpus_path(), vocab_size, staging)
        revision = revision_of(staging)
        snapshot = repo / "snapshots" / revision
        if snapshot.exists():
            shutil.rmtree(snapshot)
        staging.rename(snapshot)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp_ref = ref.with_name("main.tmp")
    tmp_ref.write_text(revision)
    os.replace(tmp_ref, ref)
    return snapshot


def check() -> None:
    """Loads the tokenizer with aiperf's own loader (by id, offline) and round-trips a line.

    ``HF_HOME`` and ``HF_HUB_OFFLINE`` must be set before huggingface_hub is first
    imported (:func:`main` does it).
    """
    from aiperf.common.tokenizer import Tokenizer  # noqa: PLC0415

    tokenizer = Tokenizer.from_pretrained(MODEL_ID)
    text = "To be, or not to be, that is the question"
    ids = tokenizer.encode(text)
    if not ids or tokenizer.decode(ids).strip() != text:
        raise RuntimeError(f"{MODEL_ID} does not round-trip a sentence: {ids}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-home", type=Path, required=True, help="the HF_HOME aiperf runs with")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    hf_home = args.hf_home.resolve()
    os.environ["HF_HOME"] = str(hf_home)  # before the first import of huggingface_hub
    os.environ["HF_HUB_OFFLINE"] = "1"
    snapshot = install(hf_home, args.vocab_size)
    check()
    print(f"aiperf_tokenizer: {MODEL_ID} ready at {snapshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
