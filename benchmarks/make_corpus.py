"""Write a synthetic pretraining corpus of about --tokens GPT-2 tokens as parquet shards of plain text: what
benchmarks/data_scale.py measures prepare_data.py and the training data path on (figures in BENCHMARKS.md).

    python benchmarks/make_corpus.py --tokens 1e9 --out-dir /tmp/corpus-1B      # 11 shards, about 4.6 GB

Words come from CPython's own documentation (the builtin corpus) with their frequencies there, followed by a
space, a comma, a full stop or a paragraph break. Document lengths are lognormal, median 500 tokens and sigma 1.1
(mean about 900): about 10% are longer than 2,048 tokens, the largest bucket of qwen2-0.5b, and a few pass
50,000. Text is built with numpy a chunk of documents at a time and handed to Arrow as one buffer, so writing
1B tokens takes minutes, not hours. Deterministic by --seed.
"""
import argparse
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import prepare_data  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tokens", type=float, default=1e9, help="about this many GPT-2 tokens in all")
parser.add_argument("--out-dir", required=True, help="folder for the shards (created)")
parser.add_argument("--shard-tokens", type=float, default=1e8, help="about this many tokens per parquet shard")
parser.add_argument("--seed", type=int, default=0)
cli = parser.parse_args()

# The vocabulary: every word of the builtin corpus up to 16 letters, weighted by its count there, times 4 endings.
counts = Counter(word for text in prepare_data.builtin_documents() for word in re.findall(r"[A-Za-z]{1,16}", text))
words, word_counts = zip(*counts.most_common())
endings, ending_p = [" ", ", ", ". ", ".\n\n"], np.array([0.86, 0.07, 0.06, 0.01])
entries = np.array([(word + ending).encode() for word in words for ending in endings], dtype="S20")
entry_p = (np.array(word_counts, dtype=np.float64)[:, None] / sum(word_counts) * ending_p).ravel()
entry_cdf = np.cumsum(entry_p)
rng = np.random.default_rng(cli.seed)


def text_of(n_words):
    """The bytes of n_words random entries, and each entry's byte length."""
    sampled = entries[np.minimum(np.searchsorted(entry_cdf, rng.random(n_words)), len(entries) - 1)]
    raw = sampled.view(np.uint8).reshape(n_words, 20)
    return raw[raw != 0], (raw != 0).sum(1)


# Tokens per word, measured once on a sample, turns token lengths into word counts.
sample, _ = text_of(200_000)
tokens_per_word = len(common.get_tokenizer().encode_ordinary(sample.tobytes().decode())) / 200_000
out_dir = Path(cli.out_dir)
out_dir.mkdir(parents=True, exist_ok=True)
written, shard, start = 0, 0, time.perf_counter()
while written < cli.tokens:
    with pq.ParquetWriter(out_dir / f"shard_{shard:04d}.parquet", pa.schema([("text", pa.string())])) as writer:
        shard_tokens = 0
        while shard_tokens < min(cli.shard_tokens, cli.tokens - written):
            doc_tokens = np.clip(rng.lognormal(np.log(500), 1.1, size=20_000), 8, 200_000)
            doc_words = np.maximum(1, (doc_tokens / tokens_per_word).astype(np.int64))
            data, entry_bytes = text_of(int(doc_words.sum()))
            doc_bytes = np.add.reduceat(entry_bytes, np.concatenate([[0], np.cumsum(doc_words)[:-1]]))
            offsets = np.concatenate([[0], np.cumsum(doc_bytes)]).astype(np.int32)  # about 80 MB a chunk: fits int32
            texts = pa.StringArray.from_buffers(len(doc_bytes), pa.py_buffer(offsets), pa.py_buffer(data))
            writer.write_table(pa.table({"text": texts}), row_group_size=10_000)
            shard_tokens += int(doc_tokens.sum())
    written += shard_tokens
    shard += 1
    print(f"shard {shard}: about {written / 1e6:,.0f}M tokens so far, {time.perf_counter() - start:.0f} s", flush=True)
print(f"wrote {shard} shards, about {written:,} tokens ({tokens_per_word:.2f} tokens per word), to {out_dir}")
