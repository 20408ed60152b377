r"""Tokenize a corpus once into memory-mapped files: what the training scripts read, at any scale.

    python prepare_data.py             # the built-in sets: data/builtin, data/builtin-sft, data/builtin-rl (seconds)
    python prepare_data.py --data HuggingFaceFW/fineweb-edu --data-config sample-10BT --max-docs 0 \
        --out-dir data/fineweb-edu
    torchrun --standalone --nproc_per_node=8 fsdp2_pretrain.py --model qwen2-0.5b --data data/fineweb-edu
    python prepare_data.py --sft --data open-thoughts/OpenThoughts-114k --max-docs 0 --out-dir data/openthoughts
    python prepare_data.py --sft --data openai/gsm8k --data-config main --max-docs 0 --out-dir data/gsm8k  # for GRPO

A prepared folder holds
    tokens.bin       uint16 token ids, the documents one after another (pretraining: each followed by <|endoftext|>)
    doc_offsets.npy  int64: document i is tokens[doc_offsets[i]:doc_offsets[i + 1]]
    loss_mask.bin    (--sft only) uint8 beside the tokens: 1 where a token is a target (assistant text, its end marker)
    meta.json        format version, tokenizer and its BPE hashes, the source, counts, each file's size and sha256
The folder is written under a hidden partial name, meta.json last, and renamed into place only when complete: an
interrupted preparation leaves nothing that training accepts. The bytes are the same for any --workers.

The training scripts take such a folder as --data and memory-map it, so a rank's memory does not grow with the
corpus; they read nothing else. Sources: 'builtin', local .txt (a document per file), .jsonl/.json (a document per
row), .parquet (read a record batch at a time), a folder of one of these kinds, a save_to_disk folder, or a Hugging
Face hub dataset (streamed). A folder that already holds the same source's tokens is kept as it is.
"""
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import socket
import sys
from collections import deque
from pathlib import Path

import numpy as np

import common
import data
import tasks

BATCH_ROWS = 1024  # rows per tokenization task: enough to amortize the hand-off, small enough to bound memory
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
BUILTIN_SETS = {"data/builtin": "pretrain", "data/builtin-sft": "sft", "data/builtin-rl": "rl"}  # without --out-dir


def add_data_arguments(add):
    """--data and how to read it."""
    add("--data", default="builtin", help="'builtin' (CPython's documentation; --sft: reasoning conversations; "
        "without --out-dir: all the built-in sets), a hub dataset name, a save_to_disk folder, local "
        ".txt/.jsonl/.json/.parquet files (text: --text-field; conversations: OpenThoughts or messages rows; problems: "
        "{prompt, answer} or {question, answer})")
    add("--data-config", default=None, help="hub dataset configuration, e.g. sample-10BT for "
        "HuggingFaceFW/fineweb-edu, main for openai/gsm8k (default: none)")
    add("--text-field", default="text", help="text: the column that holds it in .jsonl/.json/.parquet/hub data "
        "(conversations and problems are read by their schema)")
    add("--max-docs", type=common.NON_NEGATIVE_INT, default=100_000,
        help="rows taken from a hub dataset, streamed (0: all); local files and builtin are read whole")


def available_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# ----------------------------------------------------------------------------------------------
# Reading: batches (lists) of rows, never a whole corpus as Python objects.

@functools.cache  # parsing the standard library takes seconds; evaluate.py asks once per checkpoint
def builtin_documents():
    """Real English prose that ships with every CPython: the interpreter's help topics (pydoc_data)
    and the longer docstrings of the standard library, one document per module (a tuple: one copy is shared)."""
    import ast
    import pydoc_data.topics
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        if parts[0] in ("site-packages", "test", "idlelib", "lib2to3", "tkinter") or "tests" in parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docstrings = [ast.get_docstring(node) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        docstrings = [doc for doc in docstrings if doc and len(doc) >= 200]  # short ones are mostly boilerplate
        if docstrings:
            documents.append("\n\n".join(docstrings))
    return tuple(documents)


def looks_local(source):
    """Whether --data names a local path, not a hub dataset (`owner/name`): it exists, starts or ends as paths do, or
    is not of the hub's form, or its first part is a folder here (data/nope, as README names prepared folders)."""
    return (os.path.exists(os.path.expanduser(source)) or source.startswith((".", "/", "~"))
            or source.endswith(DATA_SUFFIXES) or source.count("/") != 1 or os.path.isdir(source.split("/")[0]))


def is_saved_dataset(path):
    """A folder written by datasets' save_to_disk: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def data_files(source):
    """The local files --data names, checked: they exist, are of one kind, and are not all empty."""
    path = Path(source).expanduser()
    if not path.exists():
        raise common.UsageError(f"--data {source} does not exist: pass an existing file or folder, a hub dataset "
                                f"(owner/name), or 'builtin'")
    if path.is_dir() and is_saved_dataset(path):  # its own files: arrow shards and the json that describes them
        return sorted(p for p in path.rglob("*") if p.is_file())
    files = [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.suffix in DATA_SUFFIXES]
    files = [f for f in files if f.is_file()]
    if not files:
        raise common.UsageError(f"--data {source} holds no {'/'.join(DATA_SUFFIXES)} files, nor a dataset written by "
                                f"save_to_disk")
    if all(f.stat().st_size == 0 for f in files):
        what = "is an empty file" if path.is_file() else "holds only empty files"
        raise common.UsageError(f"--data {source} {what}: point it at data")
    suffixes = {f.suffix for f in files}
    if len(suffixes) > 1:
        raise common.UsageError(f"--data {source} mixes file types ({', '.join(sorted(suffixes))}): point it at one "
                                f"kind")
    return files


def batched(rows, size=BATCH_ROWS):
    iterator = iter(rows)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def read_file(path, text_field):
    """Batches of rows of one local file. A .txt file is one document; .json is a list of rows or JSON lines."""
    if path.suffix == ".txt":
        yield [{text_field: path.read_text(encoding="utf-8")}]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        columns = [text_field] if text_field in parquet.schema_arrow.names else None  # pretraining reads one column
        for record_batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield record_batch.to_pylist()
    else:
        with open(path, encoding="utf-8") as lines:
            # A JSON array of rows is read whole (large corpora come as .jsonl).
            if path.suffix == ".json" and lines.read(1) == "[":
                lines.seek(0)
                yield from batched(json.load(lines))
                return
            lines.seek(0)
            yield from batched(json.loads(line) for line in lines if line.strip())


def read_saved_dataset(path):
    """Batches of rows of a save_to_disk folder (a DatasetDict: its train split), read from its arrow files."""
    import datasets

    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise common.UsageError(f"--data {path} holds the splits {', '.join(dataset)} and no 'train' split: "
                                    f"point --data at the split's own folder")
        dataset = dataset["train"]
    for start in range(0, len(dataset), BATCH_ROWS):
        columns = dataset[start:start + BATCH_ROWS]
        yield [dict(zip(columns, values)) for values in zip(*columns.values())]


class HubUnreachable(common.ReportedError):
    """--data names a Hugging Face hub dataset, and the hub cannot be reached (no network, or offline mode). Not the
    flags' fault. Exit status 6."""
    exit_status = 6


def read_rows(args):
    """Batches of rows (dicts) of --data: local files one batch at a time, or a hub dataset, streamed."""
    if not looks_local(args.data):
        import datasets
        import huggingface_hub

        try:  # one request first: a name the hub does not hold, or no hub, is said at once (load_dataset retries)
            huggingface_hub.HfApi().dataset_info(args.data, timeout=10)
        except huggingface_hub.errors.RepositoryNotFoundError:
            raise common.UsageError(f"--data {args.data} is no local file or folder, nor a dataset on the Hugging Face "
                                    f"hub: check the path or the name") from None
        except Exception as error:  # no network, offline mode, the hub down: its client's own kinds
            raise HubUnreachable(f"--data {args.data} is no local file or folder, and the Hugging Face hub cannot be "
                                 f"reached ({common.error_reason(error)}): check the path, or the network (or prepare "
                                 f"the data with prepare_data.py where the hub can be reached)") from None
        datasets.disable_progress_bars()
        try:  # streamed, so that only the documents we take are downloaded
            rows = datasets.load_dataset(args.data, args.data_config, split="train", streaming=True)
        except ConnectionError as error:  # what load_dataset raises when the hub cannot be reached (or HF_HUB_OFFLINE)
            raise HubUnreachable(f"--data {args.data} is no local file or folder, and the Hugging Face hub cannot be "
                                 f"reached ({common.error_reason(error)}): check the path, or the network (or prepare "
                                 f"the data with prepare_data.py where the hub can be reached)") from None
        except (datasets.exceptions.DatasetNotFoundError, ValueError) as error:  # no such dataset or configuration
            raise common.UsageError(f"--data {args.data} is no local file or folder, nor a dataset on the Hugging Face "
                                    f"hub ({common.error_reason(error)}): check the path, the name and --data-config"
                                    ) from None
        yield from batched(rows.take(args.max_docs) if args.max_docs else rows)
        return
    path, files = Path(args.data).expanduser(), data_files(args.data)  # checked: a bad path is one error line
    if path.is_dir() and is_saved_dataset(path):
        sources = [(path, read_saved_dataset(path))]
    else:
        sources = [(file, read_file(file, args.text_field)) for file in files]
    for path, batches in sources:
        try:
            for rows in batches:
                if not all(isinstance(row, dict) for row in rows):
                    raise ValueError("a row is not a JSON object")
                yield rows
        except common.UsageError:
            raise
        except (OSError, ValueError) as error:  # not UTF-8, a broken JSON line, not parquet, not JSON objects
            raise common.UsageError(f"--data {args.data} could not be read ({path.name}: "
                                    f"{common.error_reason(error)})") from None


def pretraining_texts(args):
    """Batches of document texts. Rows whose --text-field is empty, blank or not text are skipped."""
    if args.data == "builtin":
        yield list(builtin_documents())
        return
    for rows in read_rows(args):
        if rows and args.text_field not in rows[0]:
            raise common.UsageError(f"--data {args.data} has no column '{args.text_field}' (columns: "
                                    f"{', '.join(rows[0])}): set --text-field")
        texts = [row.get(args.text_field) for row in rows]
        yield [text for text in texts if isinstance(text, str) and text.strip()]


def conversation_messages(row, source):
    """[(role, text), ...] from a row in the OpenThoughts schema (system + conversations of {from, value}), the
    messages schema ({role, content}), or an answer-only problem: {prompt, answer} or GSM8K's {question, answer}
    (its answer after "####"), whose reply is the bare answer between the solution markers."""
    messages = [("system", row["system"])] if row.get("system") else []
    if isinstance(row.get("conversations"), list):
        turns = [(turn.get("from"), turn.get("value")) for turn in row["conversations"]]
        messages += [({"human": "user", "gpt": "assistant"}.get(role, role), text) for role, text in turns]
    elif isinstance(row.get("messages"), list):
        messages = [(turn.get("role"), turn.get("content")) for turn in row["messages"]]
    elif "prompt" in row or "question" in row:
        answer = row.get("answer")
        if not isinstance(answer, (str, int, float)) or not str(answer).rsplit("####", 1)[-1].strip():
            raise common.UsageError(f"--data {source}: a row has a {'prompt' if 'prompt' in row else 'question'} but "
                                    f"no 'answer' to check replies against")
        answer = str(answer).rsplit("####", 1)[-1].strip()  # GSM8K: the worked solution, then "#### 72"
        messages += [("user", row.get("prompt", row.get("question"))),
                     ("assistant", f"<|begin_of_solution|>\n\n{answer}\n\n<|end_of_solution|>")]
    else:
        raise common.UsageError(f"--data {source}: a row has none of 'conversations' (OpenThoughts), 'messages', "
                                f"'prompt' or 'question' (columns: {', '.join(row)})")
    for role, text in messages:
        if role not in common.ROLE_MARKERS or not isinstance(text, str):
            raise common.UsageError(f"--data {source}: a turn has role {role!r} (expected system, user or assistant) "
                                    f"or no text")
    if not any(role == "assistant" for role, _ in messages):
        raise common.UsageError(f"--data {source}: a conversation has no assistant turn, so nothing to learn from")
    return messages


def builtin_records(kind):
    """The built-in set of a kind of conversation data: "sft" reasoning conversations, "rl" answer-only problems."""
    return tasks.builtin_sft_records() if kind == "sft" else tasks.builtin_rl_records()


def sft_conversations(args, kind="sft"):
    """Batches of conversations [(role, text), ...], each row checked against the schemas."""
    batches = batched(builtin_records(kind)) if args.data == "builtin" else read_rows(args)
    for rows in batches:
        yield [conversation_messages(row, args.data) for row in rows]


# ----------------------------------------------------------------------------------------------
# Tokenizing: in worker processes, a batch at a time; results come back in order.

def encode_documents(texts):
    """Token ids of a batch of documents, each followed by <|endoftext|>, and each one's length."""
    ids = common.get_tokenizer().encode_ordinary_batch(texts, num_threads=1)  # the pool is the parallelism
    lengths = np.fromiter((len(doc) + 1 for doc in ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(itertools.chain(doc, (common.EOT_ID,)) for doc in ids),
                         dtype=np.int64, count=int(lengths.sum()))
    return tokens, None, lengths


def encode_conversation(tokenizer, messages):
    """Token ids and labels of a conversation [(role, text), ...]: <|role|> text <|end_of_turn|> per turn.

    Role markers come only from here. Inside assistant text the literal reasoning markers become their
    special tokens; every other marker string, and any marker inside system or user text, stays plain
    text, so no message can forge a turn. Labels: assistant text and its end marker; nothing else.
    """
    tokens, labels = [], []
    for role, text in messages:
        if role == "assistant":
            body = tokenizer.encode(text, allowed_special=set(common.REASONING_MARKERS), disallowed_special=())
        else:
            body = tokenizer.encode_ordinary(text)
        body.append(common.SPECIAL_TOKENS[common.END_OF_TURN])
        tokens += [common.SPECIAL_TOKENS[common.ROLE_MARKERS[role]], *body]
        labels += [common.IGNORE_INDEX, *(body if role == "assistant" else [common.IGNORE_INDEX] * len(body))]
    return tokens, labels


def encode_conversations(conversations):
    """Token ids, loss mask (1: a target) and length of each conversation, in the SFT chat format."""
    encoded = [encode_conversation(common.get_chat_tokenizer(), messages) for messages in conversations]
    lengths = np.array([len(tokens) for tokens, _ in encoded], dtype=np.int64)
    tokens = np.fromiter(itertools.chain.from_iterable(tokens for tokens, _ in encoded), dtype=np.int64,
                         count=int(lengths.sum()))
    labels = np.fromiter(itertools.chain.from_iterable(labels for _, labels in encoded), dtype=np.int64,
                         count=len(tokens))
    return tokens, (labels != common.IGNORE_INDEX).astype(np.uint8), lengths


def ordered_map(function, batches, workers):
    """function(batch) for every batch, in order, on `workers` processes, with at most 2 x workers batches in flight
    (Pool.imap would read the whole corpus ahead into its queue). The processes are forked (a spawned one would import
    its caller's main module again), and before the first batch is read, so that they do not inherit the reader's
    buffers."""
    if workers == 1:
        yield from map(function, batches)
        return
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pending = deque()
        for batch in batches:
            pending.append(pool.apply_async(function, (batch,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def as_uint16(tokens):
    """The ids as uint16, the file's type; an id that does not fit is an error, never a silent wrap-around."""
    if len(tokens) and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"token id {int(tokens.max())} does not fit in uint16 (at most 65,535): tokens.bin cannot "
                         f"hold this vocabulary")
    return tokens.astype(np.uint16)


# ----------------------------------------------------------------------------------------------
# Writing: a hidden partial folder, meta.json last, then one rename.

def source_identity(args, kind):
    """What the prepared tokens are a function of: a folder that records the same is not prepared again."""
    if args.data == "builtin" and kind == "pretrain":  # the text comes from this very interpreter
        source = ["builtin", sys.version]
    elif args.data == "builtin":  # the SFT or RL set, from its generator
        source = ["builtin", hashlib.sha256(json.dumps(builtin_records(kind)).encode()).hexdigest()]
    elif looks_local(args.data) and Path(args.data).expanduser().exists():
        source = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in data_files(args.data)]
    else:
        source = [args.data, args.data_config, args.max_docs]
    return {"data": args.data, "identity": source, "text_field": args.text_field}


def remove_stale_partials(out_dir):
    """Partial folders of preparations on this machine whose process is gone (killed): never complete, only disk."""
    host = socket.gethostname()
    for partial in out_dir.parent.glob(f".{out_dir.name}.partial-{host}-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(partial, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def prepare(args, kind, out_dir, workers, progress=True):
    """Tokenize --data into the prepared folder out_dir (kind: "pretrain", "sft" or "rl"; the last two differ only in
    what 'builtin' is, and are stored alike as "sft"), unless it holds them already. Returns its meta."""
    from tqdm import tqdm

    out_dir, source = Path(out_dir), source_identity(args, kind)
    if out_dir.exists():
        try:
            meta = json.loads((out_dir / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        if meta.get("source") == source and meta.get("version") == data.PREPARED_VERSION:
            return {**meta, "kept": True}  # prepared before (the training scripts check its files and tokenizer)
        raise common.UsageError(f"--out-dir {out_dir} already exists and holds other data: choose a new folder (a "
                                f"prepared folder is never overwritten)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out_dir)
    partial = out_dir.with_name(f".{out_dir.name}.partial-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    if kind == "pretrain":
        batches, encode = pretraining_texts(args), encode_documents
    else:
        batches, encode = sft_conversations(args, kind), encode_conversations
        kind = "sft"
    names = ["tokens.bin"] + (["loss_mask.bin"] if kind == "sft" else [])
    digests, lengths = {name: hashlib.sha256() for name in names}, []
    try:
        files = {name: open(partial / name, "wb") for name in names}
        with tqdm(desc=f"tokenizing {args.data}", unit="tok", unit_scale=True, disable=not progress,
                  mininterval=1, delay=1) as bar:  # delay: an error in the first second shows no empty bar
            for tokens, mask, doc_lengths in ordered_map(encode, batches, workers):
                for name, array in zip(names, (as_uint16(tokens), mask)):  # pretraining: tokens.bin only
                    files[name].write(array)
                    digests[name].update(array)
                lengths.append(doc_lengths)
                bar.update(len(tokens))
        for file in files.values():
            file.close()
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths or [np.zeros(0, np.int64)]))]).astype(np.int64)
        if len(offsets) == 1:
            what = "documents" if kind == "pretrain" else "conversations"
            raise common.UsageError(f"--data {args.data} holds no {what}: check the path, --data-config and "
                                    f"--text-field")
        np.save(partial / "doc_offsets.npy", offsets)
        digests["doc_offsets.npy"] = hashlib.sha256((partial / "doc_offsets.npy").read_bytes())
        files = {name: {"bytes": (partial / name).stat().st_size, "sha256": digest.hexdigest()}
                 for name, digest in digests.items()}
        meta = {"format": data.PREPARED_FORMAT, "version": data.PREPARED_VERSION, "kind": kind,
                "tokenizer": data.tokenizer_identity(kind == "sft"),
                "source": source, "documents": len(offsets) - 1, "tokens": int(offsets[-1]),
                "files": files,  # names the data in checkpoints, through this hash of the files' hashes:
                "content_sha256": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()}
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))  # last: a folder without it is not complete
        try:
            os.rename(partial, out_dir)
        except OSError:  # another process (a node sharing the folder) finished the same folder first: keep theirs
            if not (out_dir / "meta.json").is_file():
                raise
            shutil.rmtree(partial)
        return meta
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


if __name__ == "__main__":
    import time

    parser = common.ArgumentParser(__doc__)
    add_data_arguments(parser.add_argument)
    parser.add_argument("--out-dir", default=None, help="the prepared folder to write: new, or one that holds this "
                        "source already (kept); without it, --data builtin writes all the built-in sets into data/")
    parser.add_argument("--sft", action="store_true",
                        help="conversations (tokens plus a loss mask on the replies), not pretraining text")
    parser.add_argument("--workers", type=common.COUNT, default=available_cores(),
                        help="tokenizing processes (the default: one per core)")
    args = parser.parse_args()
    if args.out_dir is None and args.data != "builtin":
        parser.error(f"--data {args.data} needs --out-dir: the folder to write")
    jobs = BUILTIN_SETS if args.out_dir is None else {args.out_dir: "sft" if args.sft else "pretrain"}
    for out_dir, kind in jobs.items():
        start = time.perf_counter()
        meta = prepare(args, kind, out_dir, args.workers)
        seconds = time.perf_counter() - start
        what = f"{meta['documents']:,} {'documents' if kind == 'pretrain' else 'conversations'}, {meta['tokens']:,} "\
               f"tokens"
        print(f"{out_dir} holds {what} already: kept" if meta.get("kept") else f"prepared {what} in {seconds:.1f} s "
              f"({meta['tokens'] / seconds:,.0f} tokens/s, {args.workers} workers) into {out_dir}")
