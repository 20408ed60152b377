"""Pretrain a Qwen2-architecture LM with FSDP2 and Muon: each matrix's update orthogonalized whole by one owner rank.

    torchrun --standalone --nproc_per_node=2 fsdp2_muon_pretrain.py           # default: small model, data/builtin
    torchrun --standalone --nproc_per_node=8 fsdp2_muon_pretrain.py --model qwen2-0.5b --data data/fineweb-edu

--data: folders of prepare_data.py (`python prepare_data.py` writes data/builtin; its docstring, data/fineweb-edu).
"""
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import checkpoints
import common
import data
import metrics
import modeling

SCRIPT = Path(__file__).stem  # names the run folder and is recorded in every checkpoint
# The scripts that resume its checkpoints (recorded in each): its optimizer state is Muon's, which no other one reads.
RESUMED_BY = [SCRIPT]
# What --init-from reads, the weights only: a model/ folder of DCP shards (the FSDP2 layout), of any optimizer's run.
STARTS_FROM = ["fsdp2_pretrain", "fsdp2_tp_pretrain", "fsdp2_cp_pretrain", "pp_pretrain", "fsdp2_sft", "fsdp2_grpo",
               "fsdp2_3d_pretrain", "fsdp2_muon_pretrain"]
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
parser.add_argument("--init-from", default=None, help="start from the weights of a checkpoint of the FSDP2 layout, "
                    "AdamW's or Muon's (a checkpoint folder, or a run folder: its newest) at step 0, with a fresh "
                    "optimizer and schedule (default: none, the model's own init)")
parser.add_argument("--reshard-after-forward", type=common.boolean, default=True, help="true: a layer's gathered "
                    "parameters are freed after forward, gathered again in backward (ZeRO-3); false: kept (ZeRO-2)")
args = common.parse_args(parser, PRESETS)  # the flags left unset: the --model preset's
tokens_per_step = args.tokens_per_batch * args.grad_accum * world_size  # positions a step computes, padding too
args = common.finalize_args(args, tokens_per_step)
run_folder_lock = common.lock_folder(args.out_dir, "--out-dir") if rank == 0 else None  # one writer, until exit
stop_signals = common.note_stop_signals()  # SIGTERM, SIGINT, SIGUSR1: this rank's, until the step's end
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
fake = args.estimate_memory == "fake"  # estimate_memory.py's: fake tensors on a fake process group, shapes only
checkpoint_root = Path(args.out_dir) / "checkpoints"
resume_dir = checkpoints.find_resume_checkpoint(args, checkpoint_root, SCRIPT)
init_dir = None if resume_dir or not args.init_from else checkpoints.find_init_checkpoint(args, STARTS_FROM)

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
    dcp.load(model.state_dict(), checkpoint_id=init_dir / "model")  # in place: a state_dict's tensors are the weights
n_params, model_config = model.num_parameters(), model.config  # transformers' count: a tied weight once
if rank == 0:
    common.write_config(args, SCRIPT, world_size, device, dtype, n_params, tokens_per_step, resume_dir or init_dir)
if args.compile:
    torch._dynamo.config.recompile_limit = 2 * len(args.buckets)  # per bucket a training and an evaluation graph
    for layer in model.model.layers.children():  # regional: all layers share each bucket's graph; hooks stay outside
        layer.compile(dynamic=False)  # in place (state_dict keys unchanged); static shapes: each bucket its own kernels

# ---------------------------------------------------------------------------------------------- wrap
# bf16: compute on bf16 copies of the gathered parameters; reduce gradients and keep the shards in fp32.
mixed_precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
for layer in model.model.layers:  # one unit per decoder layer: only one layer is ever gathered at a time
    fully_shard(layer, mp_policy=mixed_precision, reshard_after_forward=args.reshard_after_forward)
fully_shard(model, mp_policy=mixed_precision)  # the root: embedding, tied head, final norm; default mesh: all ranks

# ---------------------------------------------------------------------------------------------- optimizer
def newton_schulz(update, dtype, steps=5, coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7):
    """Muon's orthogonalization, torch.optim.Muon's iteration in dtype (bf16 on a GPU, as torch's always is): at a
    spectral norm of at most 1, five quintic steps push the singular values up towards 1, the vectors kept (U S V^T ->
    U S' V^T); S' is 0.7-1.2 for a random matrix, mostly 0.1-0.5 for a low-rank-plus-noise one (as gradients are)."""
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]  # iterate on the wide form: its Gram matrix is the smaller one
    x = (x.T if tall else x) / x.norm().clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return (x.T if tall else x).float().contiguous()  # rows in memory order: they are dealt out to the ranks


class MuonWithAdamW(torch.optim.AdamW):
    """torch's AdamW for every group but the "muon" one, whose matrices take Muon over FSDP2's row shards: momentum
    on each rank's own shard, each matrix gathered whole to one owner rank, orthogonalized there, scattered back."""
    momentum, rms_scale = 0.95, 0.2  # torch.optim.Muon's momentum; 0.2: AdamW's typical update RMS (Moonlight)

    @torch.no_grad()
    def step(self, closure=None):  # (the script passes no closure: AdamW's would run after Muon's update)
        group = next(group for group in self.param_groups if group.get("muon"))
        matrices = [p for p in group["params"] if p.grad is not None]
        assert all(p.placements == (torch.distributed.tensor.Shard(0),) and p.device_mesh.size() == world_size
                   for p in matrices), "rows over all ranks (FSDP2's Shard(0)): HSDP or TP need a step of their own"
        for p in matrices:  # one buffer per matrix (AdamW keeps two), a DTensor sharded as its matrix: DCP reshards it;
            if not (state := self.state[p]):  # and a step count, which AdamW's loader expects in each parameter's state
                state.update(momentum_buffer=torch.zeros_like(p), step=torch.zeros(()))
            state["step"] += 1
        shards, grads = [p.to_local() for p in matrices], [p.grad.to_local() for p in matrices]
        buffers = [self.state[p]["momentum_buffer"].to_local() for p in matrices]
        torch._foreach_lerp_(buffers, grads, 1 - self.momentum)  # element by element: each rank its own rows
        updates = torch._foreach_lerp(grads, buffers, self.momentum)  # Nesterov's: the gradient, momentum of the way
        # Matrix i's owner is rank i % world: each rank's rows, padded to FSDP2's chunk (ceil(rows / world)), go to it
        # to be orthogonalized whole, and come back. A rank sends and receives 2/world of the matrices (qwen2-0.5b, 8
        # GPUs: 0.31 GB fp32; all-gathering all: 1.25 GB); the busiest rank's Newton-Schulz: the mean at 8, 2.3x at 64.
        chunks = [math.ceil(p.shape[0] / world_size) for p in matrices]
        sent = [F.pad(update, (0, 0, 0, chunk - len(update))) for update, chunk in zip(updates, chunks)]
        gathered = [[torch.empty_like(x) for _ in range(world_size)] if i % world_size == rank else None
                    for i, x in enumerate(sent)]  # the owner's: every rank's piece of its matrix
        for work in [dist.gather(x, pieces, dst=i % world_size, async_op=True) for i, (x, pieces) in
                     enumerate(zip(sent, gathered))]:
            work.wait()
        orthogonal = [None] * len(matrices)  # the owner's: its matrix orthogonalized, cut into the ranks' pieces again
        for i in range(rank, len(matrices), world_size):  # this rank's own, all at once, while the others do theirs
            whole = newton_schulz(torch.cat(gathered[i])[:len(matrices[i])], dtype)
            orthogonal[i] = list(F.pad(whole, (0, 0, 0, chunks[i] * world_size - len(whole))).chunk(world_size))
        received = [torch.empty_like(x) for x in sent]  # this rank's rows of each orthogonalized update
        for work in [dist.scatter(x, pieces, src=i % world_size, async_op=True) for i, (x, pieces) in
                     enumerate(zip(received, orthogonal))]:
            work.wait()
        # As torch.optim.Muon's adjust_lr_fn="match_rms_adamw": decay at --lr, a step rms_scale x sqrt(max(shape)) x lr
        torch._foreach_mul_(shards, 1 - group["lr"] * group["weight_decay"])
        for shard, x, p in zip(shards, received, matrices):
            shard.add_(x[:len(shard)], alpha=-group["lr"] * self.rms_scale * math.sqrt(max(p.shape)))
            p.grad = None  # AdamW, below, leaves a parameter without a gradient alone
        return super().step(closure)


# Matrices decay; biases and norm gains do not: decided by name, the same rule in every script. Muon takes the decoder
# layers' matrices; AdamW the vectors and the tied embedding (its rows are looked up, not a map to orthogonalize).
for_muon = {name: p for name, p in model.named_parameters() if p.ndim == 2 and ".layers." in name}
decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "norm" in name or name in for_muon)]
no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "norm" in name]
groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0},
          {"params": list(for_muon.values()), "weight_decay": args.weight_decay, "muon": True}]
optimizer = MuonWithAdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


# ---------------------------------------------------------------------------------------------- training step
def train_step(batches, target_tokens):
    """Forward and backward over this rank's micro-batches [(input_ids, targets)] of a step with target_tokens targets
    on all ranks; the gradients clipped. Returns this rank's summed loss and the global gradient norm."""
    loss_sum = torch.zeros((), device=device)
    for micro, (input_ids, targets) in enumerate(batches):
        # Divide by the target tokens of the WHOLE step (all ranks, all micro-batches), not by this batch's:
        # a long sample then weighs as much as it would in one big batch. The gradient sync averages over
        # ranks, so we multiply by world_size to turn that average back into the sum.
        model.set_requires_gradient_sync(micro == len(batches) - 1)  # FSDP2's switch for no_sync()
        # The summed loss; logits only at target positions, a chunk at a time (modeling.Qwen2WithChunkedLoss).
        micro_loss_sum = model(input_ids=input_ids, targets=targets)
        (micro_loss_sum * world_size / target_tokens).backward()
        loss_sum += micro_loss_sum.detach()
    # Every gradient's norm in one foreach kernel, in fp64: on a CPU fp32 drifts ~1e-4 on big tensors (pytorch#169237).
    norms = torch._foreach_norm([p.grad for p in model.parameters()], 2, torch.float64)  # DTensors: each shard's
    grad_norm = torch.stack(norms).square().sum().sqrt().float().full_tensor()  # one all-reduce adds the shards'
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip or float("inf"), grad_norm)
    return loss_sum, grad_norm


if args.estimate_memory:  # estimate_memory.py: this step, measured per bucket on full batches; the process ends there
    metrics.estimate_memory(args, model, optimizer, train_step, device, lambda rows: args.grad_accum)


# ---------------------------------------------------------------------------------------------- checkpoint
def save_checkpoint(step, data_position):
    """Every rank writes its own shards with DCP into a partial folder that is renamed once complete."""
    partial_dir = checkpoint_root / f".partial_step_{step}"
    if rank == 0:
        shutil.rmtree(partial_dir, ignore_errors=True)
        partial_dir.mkdir(parents=True)
        torch.save({"step": step, "data_position": data_position, "rng": torch.get_rng_state(),
                    "eval_owed": eval_owed}, partial_dir / "train_state.pt")  # one copy: ranks seed alike
    dist.barrier()  # the folder exists before anyone writes into it
    dcp.save(get_model_state_dict(model), checkpoint_id=partial_dir / "model")  # DTensor shards, named as in the model
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=partial_dir / "optimizer")  # keyed by name too
    if rank == 0:
        checkpoints.commit_checkpoint(partial_dir, args, SCRIPT, step, world_size, data_order, RESUMED_BY,
                                      train.chat_format)
    dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is committed


def load_checkpoint(checkpoint_dir):
    """DCP loads in place into state dicts shaped for THIS world size (so it reshards), then we set them."""
    # get_optimizer_state_dict first gives a fresh AdamW its moments: dcp.load(optimizer.state_dict()) would load none.
    model_state, optimizer_state = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    dcp.load(model_state, checkpoint_id=checkpoint_dir / "model")
    dcp.load(optimizer_state, checkpoint_id=checkpoint_dir / "optimizer")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    train_state = torch.load(checkpoint_dir / "train_state.pt", map_location="cpu", weights_only=True)
    torch.set_rng_state(train_state["rng"])
    return train_state["step"], train_state["data_position"], train_state["eval_owed"]


# ---------------------------------------------------------------------------------------------- resume
step, data_position, eval_owed = 0, {"epoch": 0, "index": 0}, False
if resume_dir is not None:
    step, data_position, eval_owed = load_checkpoint(resume_dir)
    for group in optimizer.param_groups[0], optimizer.param_groups[2]:  # the load restored the checkpoint's
        group["weight_decay"] = args.weight_decay  # this run's wins
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
