"""prepare_data.py: a corpus tokenized once into memory-mapped files, byte for byte the same for any worker count,
never half-written, and refused when it was made by another format or tokenizer."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import common
import data
import loading
import prepare_data
from helpers import PYTHON, REPO, TINY_DATA, TINY_RUN, check, prepare_folder, run_script

WORDS = ("the interpreter reads 42 lines of code, naïve café 東京 🙂 "
         "def f(x): return x ** 2\n\nand then").split(" ")


def write_parquet(path, n_docs, seed=0, words_per_doc=(1, 400)):
    """Documents of random words and lengths, plus rows a preparation must skip: blank, empty and not text."""
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(*words_per_doc))) for _ in range(n_docs)]
    texts[1], texts[2], texts[3] = "   \n ", "", None
    pq.write_table(pa.table({"text": texts, "id": list(range(n_docs))}), path, row_group_size=700)
    return texts


def args_for(folder, *flags):
    """A pretraining script's flags, reading --data FOLDER."""
    parser = common.get_parser("", "runs/x")
    parser.add_argument("--data", nargs="+")
    argv = ["--model", "tiny", "--data", str(folder), *map(str, flags)]
    return common.finalize_args(common.parse_args(parser, loading.script_presets("ddp_pretrain.py"), argv), None)


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A 3,000-document parquet file prepared in process with 1 worker, and with the command line and 2 workers."""
    tmp = tmp_path_factory.mktemp("prepare")
    texts = write_parquet(tmp / "docs.parquet", 3000)
    prepare_folder(tmp / "docs.parquet", "pretrain", tmp / "one")
    result = check(run_script("prepare_data.py", "--data", tmp / "docs.parquet", "--out-dir", tmp / "two",
                              "--workers", 2, torchrun=False))
    return tmp, texts, result


def test_prepared_bytes_are_the_same_for_1_and_2_workers_and_equal_tiktoken(prepared):
    tmp, texts, result = prepared
    for name in ("tokens.bin", "doc_offsets.npy"):
        assert sha256(tmp / "one" / name) == sha256(tmp / "two" / name)
    tokenizer = common.get_tokenizer()
    kept = [text for text in texts if isinstance(text, str) and text.strip()]  # blank, empty and missing rows skipped
    expected = [token for text in kept for token in [*tokenizer.encode_ordinary(text), common.EOT_ID]]
    tokens, offsets = np.fromfile(tmp / "one" / "tokens.bin", dtype=np.uint16), np.load(tmp / "one" / "doc_offsets.npy")
    assert tokens.tolist() == expected and len(offsets) == len(kept) + 1 and offsets[-1] == len(tokens)
    assert (tokens[offsets[1:] - 1] == common.EOT_ID).all()  # every document ends with <|endoftext|>
    meta = json.loads((tmp / "two" / "meta.json").read_text())
    assert (meta["documents"] == len(kept) and meta["tokens"] == len(expected)
            and meta["files"]["tokens.bin"]["sha256"] == sha256(tmp / "two" / "tokens.bin"))
    assert f"{len(expected):,} tokens" in result.stdout


def test_training_maps_a_prepared_folder_and_preparing_it_again_keeps_it(prepared):
    tmp, _, _ = prepared
    one, two = (data.load_pretraining_data(args_for(tmp / name)) for name in ("one", "two"))
    for a, b in zip([one[0], *one[1].values()], [two[0], *two[1].values()]):
        assert (np.array_equal(a.starts, b.starts) and np.array_equal(a.lengths, b.lengths)
                and a.content_sha256 == b.content_sha256)
    assert isinstance(two[0].tokens[0], np.memmap) and Path(two[0].tokens[0].filename) == tmp / "two" / "tokens.bin"
    before = {path.name: path.stat().st_mtime_ns for path in (tmp / "two").iterdir()}
    result = check(run_script("prepare_data.py", "--data", tmp / "docs.parquet", "--out-dir", tmp / "two"))
    assert "already: kept" in result.stdout
    assert before == {path.name: path.stat().st_mtime_ns for path in (tmp / "two").iterdir()}


@pytest.mark.parametrize("change,words", [
    (lambda meta: meta.update(version=0), "another format"),
    (lambda meta: meta["tokenizer"]["special_tokens"].update({"<|other|>": 50257}), "another tokenizer"),
    (lambda meta: None, "holds text"),  # given to a script that trains on conversations
])
def test_a_folder_of_another_format_tokenizer_or_kind_is_refused_in_one_line(change, words, prepared, tmp_path):
    folder = shutil.copytree(prepared[0] / "one", tmp_path / "copy")
    meta = json.loads((folder / "meta.json").read_text())
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(common.UsageError) as error:
        data.open_prepared(folder, "--data", conversations=words == "holds text")
    assert (str(error.value).startswith(f"--data {folder}") and words in str(error.value)
            and "\n" not in str(error.value))


def test_a_token_id_that_does_not_fit_uint16_cannot_be_written():
    assert prepare_data.as_uint16(np.array([0, 65_535])).tolist() == [0, 65_535]
    with pytest.raises(ValueError, match="65,535"):
        prepare_data.as_uint16(np.array([5, 65_536]))


def test_a_killed_preparation_leaves_no_folder_that_training_accepts(tmp_path):
    write_parquet(tmp_path / "big.parquet", 40_000, words_per_doc=(300, 500))  # a few seconds of work
    out_dir = tmp_path / "prepared"
    process = subprocess.Popen([PYTHON, str(REPO / "prepare_data.py"), "--data", str(tmp_path / "big.parquet"),
                                "--out-dir", str(out_dir), "--workers", "1"],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not any(p.stat().st_size for p in tmp_path.glob(".prepared.partial-*/tokens.bin")) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)  # mid-write: tokens.bin has grown, meta.json is not there yet
    process.wait()
    partial = next(tmp_path.glob(".prepared.partial-*"))
    assert not out_dir.exists() and (partial / "tokens.bin").stat().st_size > 0 and not (partial / "meta.json").exists()
    with pytest.raises(common.UsageError, match="no complete folder written by prepare_data.py"):
        data.load_pretraining_data(args_for(partial))
    prepare_data.remove_stale_partials(out_dir)  # what the next preparation does first: its process is gone
    assert not partial.exists()


def test_the_tiny_runs_corpus_crosses_an_epoch_boundary_between_its_checkpoints():
    """What makes every resume test from step 10 cross an epoch (helpers.TINY_RUN)."""
    args = args_for(TINY_DATA, "--tokens-per-batch", TINY_RUN[TINY_RUN.index("--tokens-per-batch") + 1])
    train, _ = data.load_pretraining_data(args)
    assert 10 < len(data.epoch_schedule(train.lengths, args.buckets, args.tokens_per_batch, 2, 1, args.seed, 0)) < 20


@pytest.mark.parametrize("layout", ["Dataset", "DatasetDict"])
def test_a_folder_written_by_save_to_disk_is_read_as_the_dataset_it_holds(layout, tmp_path):
    """The usual local copy of a Hugging Face dataset: the same samples as the same rows in a .jsonl file."""
    import datasets

    texts = [text for text in write_parquet(tmp_path / "docs.parquet", 60) if isinstance(text, str)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    dataset = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    if layout == "DatasetDict":  # the train split is read; the other split is not
        dataset = datasets.DatasetDict({"train": dataset, "test": datasets.Dataset.from_dict({"text": ["held apart"]})})
    dataset.save_to_disk(str(tmp_path / "saved"))
    for name in ("saved", "docs.jsonl"):
        prepare_folder(tmp_path / name, "pretrain", tmp_path / f"prepared-{name}")
    from_saved = data.load_pretraining_data(args_for(tmp_path / "prepared-saved"))
    from_jsonl = data.load_pretraining_data(args_for(tmp_path / "prepared-docs.jsonl"))
    for saved, jsonl in zip([from_saved[0], *from_saved[1].values()], [from_jsonl[0], *from_jsonl[1].values()]):
        assert np.array_equal(saved.lengths, jsonl.lengths) and saved.content_sha256 == jsonl.content_sha256


def test_with_no_flags_it_writes_the_three_built_in_sets_and_a_second_run_keeps_them(tmp_path):
    """README's first command: `python prepare_data.py` writes data/builtin, data/builtin-sft and data/builtin-rl
    where it runs, each the default --data of its kind of script; run again, it keeps every file as it is."""
    def prepare():
        result = subprocess.run([PYTHON, str(REPO / "prepare_data.py")], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout

    first = prepare()
    folders = {name: tmp_path / "data" / name for name in ("builtin", "builtin-sft", "builtin-rl")}
    for name, folder in folders.items():
        assert f"into data/{name}" in first
        assert data.open_prepared(folder, "--data", conversations=name != "builtin").chat_format == (name != "builtin")
    written = {path: path.stat().st_mtime_ns for path in (tmp_path / "data").rglob("*")}
    assert prepare().count("already: kept") == 3
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "data").rglob("*")} == written
