"""Pretrain a Qwen2-architecture LM with FSDP1: flat per-layer shards, DCP checkpoints as ONE Stateful app state.

    torchrun --standalone --nproc_per_node=2 fsdp1_pretrain.py                # default: small model, data/builtin
    torchrun --standalone --nproc_per_node=8 fsdp1_pretrain.py --model qwen2-0.5b --data data/fineweb-edu

--data: folders of prepare_data.py (`python prepare_data.py` writes data/builtin; its docstring, data/fineweb-edu).
"""
import functools
import json
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

import checkpoints
import common
import data
import metrics
import modeling

SCRIPT = Path(__file__).stem  # names the run folder and is recorded in every checkpoint
# The scripts that resume its checkpoints (recorded in each): the same format and data order.
RESUMED_BY = [SCRIPT]
# Each --model preset's training defaults: the values of the flags left unset (its shape: common.MODEL_PRESETS).
PRESETS = {
    "tiny": dict(buckets=[32, 48, 64, 96, 128], tokens_per_batch=512, lr=3e-3, warmup_steps=5, max_steps=20,
                 eval_every=10, save_every=10),
    "small": dict(buckets=[32, 48, 64, 96, 128, 192, 256], tokens_per_batch=1024, lr=3e-3, warmup_steps=10,
                  max_steps=60, eval_every=20, save_every=20),
    "qwen2-0.5b": dict(buckets=[256, 512, 1024, 1536, 2048], tokens_per_batch=65536, lr=3e-4, warmup_steps=200,
                       max_steps=5000, eval_every=250, save_every=500),
}

# ---------------------------------------------------------------------------------------------- setup
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
parser = common.get_parser(__doc__, f"runs/{SCRIPT}")
common.add_batch_arguments(parser)  # --grad-accum, --bucket-order
parser.add_argument("--data", nargs="+", default=["data/builtin"], help="prepared folders, or FOLDER:WEIGHT ...")
parser.add_argument("--init-from", default=None, help="start from the weights of a checkpoint this script resumes (a "
                    "checkpoint folder, or a run folder: its newest) at step 0, with a fresh optimizer and schedule "
                    "(default: none, the model's own init)")
args = common.parse_args(parser, PRESETS)  # the flags left unset: the --model preset's
tokens_per_step = args.tokens_per_batch * args.grad_accum * world_size  # positions a step computes, padding too
args = common.finalize_args(args, tokens_per_step)
run_folder_lock = common.lock_folder(args.out_dir, "--out-dir") if rank == 0 else None  # one writer, until exit
stop_signals = common.note_stop_signals()  # SIGTERM, SIGINT, SIGUSR1: this rank's, until the step's end
if args.estimate_memory:  # measured: its tracker hooks each parameter's gradient; FSDP1's parameters are views (errors)
    raise common.UsageError("--estimate-memory: torch's memory tracker cannot follow FSDP1, whose parameters are views "
                            "of its flat ones (docs/memory.md)")
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
fake = args.estimate_memory == "fake"  # estimate_memory.py's: fake tensors on a fake process group, shapes only
checkpoint_root = Path(args.out_dir) / "checkpoints"
resume_dir = checkpoints.find_resume_checkpoint(args, checkpoint_root, SCRIPT)
init_dir = None if resume_dir or not args.init_from else checkpoints.find_init_checkpoint(args, RESUMED_BY)

# ---------------------------------------------------------------------------------------------- data
# Splits: each sample's start, length and target count, as arrays over the memory-mapped tokens.
train, val = data.load_pretraining_data(args)
# What the sample order depends on (checked: enough samples); a step takes a batch per micro-batch on each rank.
samples_per_rank = [data.bucket_batch_size(args.tokens_per_batch, length) * args.grad_accum for length in args.buckets]
data_order = data.data_order(args, train, val, world_size, samples_per_rank, ["tokens_per_batch", "grad_accum"],
                             args.bucket_order)
checkpoints.check_resume(resume_dir, args, data_order)  # --resume: the same data order; says which other flags changed

# ---------------------------------------------------------------------------------------------- distributed
# Every input check is behind us: from here on the ranks talk to each other.
if rank == 0:
    checkpoints.remove_incomplete_checkpoints(checkpoint_root)  # what a crashed run left half-written
common.init_process_group(device, fake)
if device.type == "cuda":
    torch.cuda.set_device(device)
checkpoints.same_on_every_rank(resume_dir, init_dir, args)  # the ranks' lookups, compared before any load

# ---------------------------------------------------------------------------------------------- model
torch.manual_seed(args.seed)  # the same init on every rank, and in every script
model = modeling.build_model(args.model, args.activation_checkpointing, args.loss_chunk_rows, fake)
if init_dir is not None:  # midtraining: a checkpoint's weights, whole on every rank; the optimizer starts fresh
    dcp.load({"app": {"model": model.state_dict()}}, checkpoint_id=init_dir)  # in place, and only the model's entries
n_params, model_config = model.num_parameters(), model.config  # transformers' count: a tied weight once
if rank == 0:
    common.write_config(args, SCRIPT, world_size, device, dtype, n_params, tokens_per_step, resume_dir or init_dir)
if args.compile:
    torch._dynamo.config.recompile_limit = 2 * len(args.buckets)  # per bucket a training and an evaluation graph
    for layer in model.model.layers.children():  # regional: all layers share each bucket's graph; hooks stay outside
        layer.compile(dynamic=False)  # in place (state_dict keys unchanged); static shapes: each bucket its own kernels

# ---------------------------------------------------------------------------------------------- wrap
# bf16: compute on bf16 copies of the gathered parameters; reduce gradients and keep the shards in fp32.
model = FSDP(
    model,
    # One unit per decoder layer (only one layer is ever gathered); embedding, tied head and final norm in the root.
    auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer}),
    mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32),
    device_id=device,  # each unit moves to the device as it is sharded (torch.device("cpu") works too)
    use_orig_params=True,  # parameters keep their names and shapes: per-parameter weight decay, compile
)

# ---------------------------------------------------------------------------------------------- optimizer
# Matrices decay; biases and norm gains do not: decided by name, the same rule in every script.
decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "norm" in name)]
no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "norm" in name]
groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


# ---------------------------------------------------------------------------------------------- training step
def train_step(batches, target_tokens):
    """Forward and backward over this rank's micro-batches [(input_ids, targets)] of a step with target_tokens targets
    on all ranks; the gradients clipped. Returns this rank's summed loss and the global gradient norm."""
    loss_sum = torch.zeros((), device=device)
    for micro, (input_ids, targets) in enumerate(batches):
        # Divide by the target tokens of the WHOLE step (all ranks, all micro-batches), not by this batch's:
        # a long sample then weighs as much as it would in one big batch. The gradient sync averages over
        # ranks, so we multiply by world_size to turn that average back into the sum.
        with model.no_sync() if micro < len(batches) - 1 else nullcontext():  # sync only after the last micro-batch
            # The summed loss; logits only at target positions, a chunk at a time (modeling.Qwen2WithChunkedLoss).
            micro_loss_sum = model(input_ids=input_ids, targets=targets)
            (micro_loss_sum * world_size / target_tokens).backward()
        loss_sum += micro_loss_sum.detach()
    # Every gradient's norm in one foreach kernel, in fp64: on a CPU fp32 drifts ~1e-4 on big tensors (pytorch#169237).
    norms = torch._foreach_norm([p.grad for p in model.parameters() if p.grad is not None], 2, torch.float64)
    grad_norm = torch.stack(norms).square().sum()
    dist.all_reduce(grad_norm)  # each rank summed the squares of its own shards only (FSDP1 has no DTensor)
    grad_norm = grad_norm.sqrt().float()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip or float("inf"), grad_norm)
    return loss_sum, grad_norm


# ---------------------------------------------------------------------------------------------- checkpoint
class AppState(Stateful):
    """Everything a resume needs, as ONE object: DCP calls state_dict() to save and load_state_dict() to load."""

    def __init__(self, step=0, data_position=None, eval_owed=False):
        self.step, self.data_position, self.eval_owed = step, data_position or {"epoch": 0, "index": 0}, eval_owed

    def state_dict(self):
        model_state, optimizer_state = get_state_dict(model, optimizer)  # sharded: each rank gives only its shards
        return {"model": model_state, "optimizer": optimizer_state, "step": self.step,
                "data_position": self.data_position, "eval_owed": self.eval_owed, "rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        torch.set_rng_state(state["rng"])  # one copy was saved: every rank seeds alike and there is no dropout
        self.step, self.data_position, self.eval_owed = state["step"], state["data_position"], state["eval_owed"]


def save_checkpoint(step, data_position):
    """Every rank writes its own shards with DCP into a partial folder that is renamed once complete."""
    partial_dir = checkpoint_root / f".partial_step_{step}"
    if rank == 0:
        shutil.rmtree(partial_dir, ignore_errors=True)
        partial_dir.mkdir(parents=True)
    dist.barrier()  # the folder exists before anyone writes into it
    dcp.save({"app": AppState(step, data_position, eval_owed)}, checkpoint_id=partial_dir)
    if rank == 0:
        checkpoints.commit_checkpoint(partial_dir, args, SCRIPT, step, world_size, data_order, RESUMED_BY,
                                      train.chat_format)
    dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is committed


def load_checkpoint(checkpoint_dir):
    """DCP reads into the state dict AppState hands it (shaped for THIS world size), then calls load_state_dict."""
    app_state = AppState()
    dcp.load({"app": app_state}, checkpoint_id=checkpoint_dir)
    return app_state.step, app_state.data_position, app_state.eval_owed


# ---------------------------------------------------------------------------------------------- resume
step, data_position, eval_owed = 0, {"epoch": 0, "index": 0}, False
if resume_dir is not None:
    step, data_position, eval_owed = load_checkpoint(resume_dir)
    optimizer.param_groups[0]["weight_decay"] = args.weight_decay  # the load restored the checkpoint's: this run's wins
    if rank == 0:
        print(f"resumed from {resume_dir} at step {step}")


def make_schedule(split, epoch, grad_accum, order):  # a split's epoch (a mixture's: each source its token share)
    return data.epoch_schedule(split.lengths, args.buckets, args.tokens_per_batch, world_size, grad_accum, args.seed,
                               epoch, order, data.epoch_samples(split, args.seed, epoch))


# ---------------------------------------------------------------------------------------------- evaluation
val_schedules = {name: make_schedule(split, 0, 1, "ascending") for name, split in val.items()}


@torch.no_grad()
def evaluate():
    """Loss over each source's validation split (summed over all its tokens on all ranks, then divided once), and over
    them all (val_loss: their token-weighted mean)."""
    model.eval()
    loss_sums = torch.zeros(len(val), device=device)
    for i, (name, schedule) in enumerate(val_schedules.items()):
        for bucket_len, samples in schedule:
            batch_size = data.bucket_batch_size(args.tokens_per_batch, bucket_len)
            input_ids, targets = data.collate(val[name], samples[rank::world_size], bucket_len, batch_size, device)
            loss_sums[i] += model(input_ids=input_ids, targets=targets)  # summed over the targets
    dist.all_reduce(loss_sums)
    model.train()
    target_counts = [sum(split.target_counts) for split in val.values()]
    return {"val_loss": loss_sums.sum().item() / sum(target_counts),
            **{f"val_loss/{name}": loss / count for name, loss, count in zip(val, loss_sums.tolist(), target_counts)}}


# ---------------------------------------------------------------------------------------------- training loop
if rank == 0:
    metrics_file = metrics.open_metrics(Path(args.out_dir) / "metrics.jsonl", step if resume_dir else None)
    # On resume, TensorBoard drops a crashed run's points after the checkpoint's step.
    writer = SummaryWriter(Path(args.out_dir) / "tensorboard", purge_step=step + 1 if resume_dir else None)
    progress = tqdm(total=args.max_steps, initial=step, desc=SCRIPT, dynamic_ncols=True)


def log(row):
    if rank == 0:
        metrics_file.write(f"{json.dumps(row)}\n".encode())  # one write(2) per row (metrics.open_metrics)
        for name, value in row.items():
            if name != "step" and value is not None:
                writer.add_scalar(name, value, row["step"])


peak_flops = metrics.device_peak_flops(device)
schedule = make_schedule(train, data_position["epoch"], args.grad_accum, args.bucket_order)
start_time, total_tokens, total_padded, run_peak_mem_gb, stop_votes = time.perf_counter(), 0, 0, 0.0, 0
validation = evaluate() if step == 0 or eval_owed else {}  # a stopped run's skipped evaluation is made up
if validation:
    log({"step": step, **validation})
model.train()
while step < args.max_steps and not stop_votes:
    if data_position["index"] >= len(schedule):  # epoch done: the next one reshuffles, as a function of (seed, epoch)
        data_position = {"epoch": data_position["epoch"] + 1, "index": 0}
        schedule = make_schedule(train, data_position["epoch"], args.grad_accum, args.bucket_order)
    bucket_len, step_samples = schedule[data_position["index"]]  # the step's samples, all ranks' and micro-batches'
    data_position = {**data_position, "index": data_position["index"] + 1}
    batch_size = data.bucket_batch_size(args.tokens_per_batch, bucket_len)
    tokens = int(train.lengths[step_samples].sum())
    target_tokens = int(train.target_counts[step_samples].sum())  # positions with a loss, all ranks
    step_start = time.perf_counter()

    # Dealt round-robin (a bucket's short last step spreads evenly over the ranks); made while the GPU runs the update.
    batches = [data.collate(train, step_samples[micro * world_size + rank::world_size * args.grad_accum], bucket_len,
                            batch_size, device) for micro in range(args.grad_accum)]
    loss_sum, grad_norm = train_step(batches, target_tokens)
    step_sums = torch.stack([loss_sum, loss_sum.new_full((), len(stop_signals))])  # any rank's signal stops all ranks
    dist.all_reduce(step_sums)  # for the log and the check (the gradients were already exact), and the stop
    loss_sum, stop_votes, grad_norm = torch.cat([step_sums, grad_norm[None]]).tolist()  # the step's one wait for it
    loss = loss_sum / target_tokens
    metrics.stop_if_nonfinite(step + 1, loss, grad_norm)  # global values: all ranks stop alike, before updating
    lr = common.learning_rate(step, args)  # from the step and this run's flags: a resumed run follows a new --lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step += 1

    step_time = time.perf_counter() - step_start
    step_peak_mem_gb, step_peak_reserved_gb = metrics.step_peak_memory_gb(device)
    run_peak_mem_gb = max(run_peak_mem_gb, step_peak_mem_gb)
    padded_tokens = world_size * args.grad_accum * batch_size * bucket_len
    total_tokens, total_padded = total_tokens + tokens, total_padded + padded_tokens
    flops = modeling.flops_per_token(n_params, model_config, bucket_len) * tokens
    mfu = flops / step_time / (peak_flops * world_size) if peak_flops else None  # None where the peak is unknown (CPUs)
    if step % args.log_every == 0 or step == args.max_steps:
        log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
             "padded_tokens": padded_tokens, "target_tokens": target_tokens, "bucket_len": bucket_len,
             "batch_size": batch_size, "tokens_per_s": tokens / step_time,
             "mfu": mfu, "peak_mem_gb": step_peak_mem_gb, "peak_reserved_gb": step_peak_reserved_gb,
             "elapsed_s": time.perf_counter() - start_time})
    eval_owed = stop_votes > 0 and step % args.eval_every == 0 and step < args.max_steps  # saved, made up on resume
    if step == args.max_steps or (step % args.eval_every == 0 and not eval_owed):  # a stopped step saves at once
        validation = evaluate()
        log({"step": step, **validation})
    if step % args.save_every == 0 or step == args.max_steps or stop_votes:
        with checkpoints.report_failure(args.out_dir, step):  # a refused write (a full disk): one line, no traceback
            save_checkpoint(step, data_position)
    if rank == 0:  # the bar redraws at most every 0.1 s (tqdm's mininterval), not at every step
        progress.set_postfix({"loss": f"{loss:.3f}", "tok/s": f"{tokens / step_time:,.0f}",
                              **({"mfu": f"{mfu:.1%}"} if mfu else {}), "mem": f"{step_peak_mem_gb:.2f}GB",
                              "bucket": bucket_len}, refresh=False)
        progress.update(1)

# ---------------------------------------------------------------------------------------------- end
if rank == 0:
    progress.close()
    writer.close()
    metrics_file.close()
    elapsed = time.perf_counter() - start_time
    print(f"done: {step} steps, val loss {validation.get('val_loss', float('nan')):.4f}, "
          f"non-padding share {total_tokens / max(1, total_padded):.1%}, {total_tokens / elapsed:,.0f} tokens/s, "
          f"{elapsed:.0f}s; metrics and checkpoints in {args.out_dir}")
param_elements, optimizer_elements = modeling.local_state_sizes(model, optimizer)
print(f"rank {rank} holds {param_elements:,} parameter and {optimizer_elements:,} optimizer-state elements "
      f"({n_params:,} parameters in the model), peak memory in training {run_peak_mem_gb:.2f} GB")
dist.barrier()  # without it, a rank that exits first can abort the others' gloo teardown
dist.destroy_process_group()
time.sleep(0.2)  # let gloo's threads free the last collectives' tensors: in Python's exit that aborts (pytorch#190489)
if stop_votes and step < args.max_steps:  # a signal stopped the run, its step saved: a status of its own says so
    common.exit_stopped(step, checkpoint_root)
