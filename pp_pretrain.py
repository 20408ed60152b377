"""Pretrain a Qwen2-architecture LM with pipeline parallelism: the decoder layers split into stages, one per rank.

    torchrun --standalone --nproc_per_node=2 pp_pretrain.py                   # default: small model, data/builtin
    torchrun --standalone --nproc_per_node=8 pp_pretrain.py --model qwen2-0.5b --data data/fineweb-edu --pp 4

--data: folders of prepare_data.py (`python prepare_data.py` writes data/builtin; its docstring, data/fineweb-edu).
"""
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import checkpoints
import common
import data
import metrics
import modeling

SCRIPT = Path(__file__).stem  # names the run folder and is recorded in every checkpoint
# The scripts that resume its checkpoints (recorded in each): the same format and data order.
RESUMED_BY = ["fsdp2_pretrain", "fsdp2_tp_pretrain", "fsdp2_cp_pretrain", "fsdp2_3d_pretrain", "pp_pretrain"]
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
parser.add_argument("--pp", type=common.COUNT, default=None, help="pipeline stages (default: the world size)")
parser.add_argument("--pp-schedule", choices=["gpipe", "1f1b"], default="1f1b", help="gpipe: every forward, then "
                    "every backward; 1f1b: in turn, so a stage keeps at most pp micro-batches' activations")
parser.set_defaults(grad_accum=4)  # the micro-batches that fill a pipeline: (pp - 1) / (grad_accum + pp - 1) idles
args = common.parse_args(parser, PRESETS)  # the flags left unset: the --model preset's
args.pp, n_layers = args.pp or world_size, common.MODEL_PRESETS[args.model]["model"]["num_hidden_layers"]
if n_layers % args.pp or world_size % args.pp:
    raise common.UsageError(f"--pp {args.pp} must divide the '{args.model}' preset's {n_layers} layers and the world "
                            f"size {world_size}: choose a --pp that does")
if args.pp_schedule == "1f1b" and args.grad_accum < args.pp:  # 1F1B fills every stage before its first backward
    raise common.UsageError(f"--grad-accum {args.grad_accum} is below the {args.pp} stages, which 1F1B needs at least: "
                            f"raise --grad-accum, or pass --pp-schedule gpipe")
if args.estimate_memory:  # measured: a stage asks its neighbours for shapes at its first step; a fake group sends none
    raise common.UsageError("--estimate-memory: pipeline stages exchange their tensors' shapes over the process group "
                            "before their first step, which estimate_memory.py cannot fake (docs/memory.md)")
dp_size = world_size // args.pp
tokens_per_step = args.tokens_per_batch * args.grad_accum * dp_size  # positions a step computes, padding too
args = common.finalize_args(args, tokens_per_step)
run_folder_lock = common.lock_folder(args.out_dir, "--out-dir") if rank == 0 else None  # one writer, until exit
stop_signals = common.note_stop_signals()  # SIGTERM, SIGINT, SIGUSR1: this rank's, until the step's end
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
data_order = data.data_order(args, train, val, dp_size, samples_per_rank, ["tokens_per_batch", "grad_accum"],
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
mesh = init_device_mesh(device.type, (dp_size, args.pp), mesh_dim_names=("dp", "pp"))  # rows: pipelines, each in order
dp_rank, stage_index, pp_group = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank(), mesh["pp"].get_group()
is_first, is_last = stage_index == 0, stage_index == args.pp - 1
# The tied embedding and head: a copy on each pipeline's first and last stage (new_group: every rank makes every group).
tie_group = [dist.new_group(sorted({row[0], row[-1]})) for row in mesh.mesh.tolist()][dp_rank]

# ---------------------------------------------------------------------------------------------- model
torch.manual_seed(args.seed)  # the same init on every rank, and in every script
model = modeling.build_model(args.model, args.activation_checkpointing, args.loss_chunk_rows, fake)
model = model.to(device) if device.type == "cuda" else model  # a fake tensor (--estimate-memory) cannot move
if init_dir is not None:  # midtraining: a checkpoint's weights, whole on every rank; the optimizer starts fresh
    dcp.load(model.state_dict(), checkpoint_id=init_dir / "model")  # in place: a state_dict's tensors are the weights
n_params, model_config = model.num_parameters(), model.config  # transformers' count: a tied weight once
if rank == 0:
    common.write_config(args, SCRIPT, world_size, device, dtype, n_params, tokens_per_step, resume_dir or init_dir)
# bf16 matmuls on fp32 weights: the forward and the loss run inside `with autocast:`, the backward follows their dtypes.
autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


class ModelStage(torch.nn.Module):
    """This rank's part of the model, named as in the whole model (checkpoints too); a part it lacks is None."""

    def __init__(self, causal_lm, layer_ids):
        super().__init__()
        self.model = causal_lm.model  # the decoder, cut down in place to this stage's parts
        self.model.layers = torch.nn.ModuleDict({str(i): self.model.layers[i] for i in layer_ids})
        self.model.embed_tokens = causal_lm.model.embed_tokens if is_first or is_last else None  # last: tied head
        self.model.norm, self.lm_head = (causal_lm.model.norm, causal_lm.lm_head) if is_last else (None, None)

    def forward(self, hidden):  # token ids into the first stage, the final norm's output out of the last
        with autocast:
            hidden = self.model.embed_tokens(hidden) if is_first else hidden
            rotary = self.model.rotary_emb(hidden, torch.arange(hidden.shape[1], device=hidden.device)[None])  # cos/sin
            for layer in self.model.layers.values():
                hidden = layer(hidden, position_embeddings=rotary)
            return self.model.norm(hidden) if is_last else hidden

    def loss(self, output, targets, scale):  # the last stage's: the chunked loss of the norm's output and the head
        with autocast:
            return modeling.chunked_cross_entropy(output, self.lm_head.weight, targets) * scale


model = ModelStage(model, range(stage_index * n_layers // args.pp, (stage_index + 1) * n_layers // args.pp))
if args.compile:
    torch._dynamo.config.recompile_limit = 2 * len(args.buckets)  # per bucket a training and an evaluation graph
    for layer in model.model.layers.children():  # regional: all layers share each bucket's graph; hooks stay outside
        layer.compile(dynamic=False)  # in place (state_dict keys unchanged); static shapes: each bucket its own kernels

# ---------------------------------------------------------------------------------------------- wrap
# No DDP: under the schedules' backward per micro-batch its reducer leaves the last stage unsynced (torch 2.13).

# ---------------------------------------------------------------------------------------------- optimizer
# Matrices decay; biases and norm gains do not: decided by name, the same rule in every script.
decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "norm" in name)]
no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "norm" in name]
groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


# ---------------------------------------------------------------------------------------------- pipeline
pipeline_schedules = {}  # bucket length -> its stage's schedule: a stage sizes its messages for one shape only


def run_pipeline(batches, scale, train):
    """This pipeline's micro-batches [(input_ids, targets)] through the stages; their losses' sum times scale (0 but on
    the last stage)."""
    bucket_len = batches[0][0].shape[1]
    if bucket_len not in pipeline_schedules:
        stage = PipelineStage(model, stage_index, args.pp, device, group=pp_group)
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.pp_schedule]
        # scale_grads=False: the loss is already a sum over the whole step, not to be divided by the micro-batches.
        pipeline_schedules[bucket_len] = schedule(stage, args.grad_accum, loss_fn=model.loss, scale_grads=False)
    input_ids, targets = (torch.cat(tensors) for tensors in zip(*batches))
    schedule, losses = pipeline_schedules[bucket_len], []
    (schedule.step if train else schedule.eval)(*([input_ids] if is_first else []), target=targets if is_last else None,
                                                losses=losses, loss_kwargs={"scale": scale})
    return torch.stack(losses).sum().detach() if is_last else torch.zeros((), device=device)


# ---------------------------------------------------------------------------------------------- training step
def train_step(batches, target_tokens):
    """Forward and backward over this pipeline's micro-batches [(input_ids, targets)] of a step with target_tokens
    targets on all pipelines; the gradients clipped. Returns this rank's summed loss and the global gradient norm."""
    # Divide by the target tokens of the WHOLE step (all pipelines, all micro-batches), as ddp_pretrain.py does.
    loss_sum = run_pipeline(batches, 1 / target_tokens, True) * target_tokens
    for grad in [p.grad for p in model.parameters()] if dp_size > 1 else []:  # the stage's replicas: the sum of theirs
        dist.all_reduce(grad, group=mesh["dp"].get_group())
    if is_first or is_last:  # the embedding's copy and the head's are one weight: one gradient, the sum of both
        dist.all_reduce(model.model.embed_tokens.weight.grad, group=tie_group)
    # Every gradient's norm in one foreach kernel, in fp64: on a CPU fp32 drifts ~1e-4 on big tensors (pytorch#169237).
    norms = torch._foreach_norm([p.grad for name, p in model.named_parameters()  # tied: counted once
                                 if is_first or not name.startswith("model.embed_tokens")], 2, torch.float64)
    grad_norm = torch.stack(norms).square().sum()
    dist.all_reduce(grad_norm, group=pp_group)  # the stages' squares, summed
    grad_norm = grad_norm.sqrt().float()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip or float("inf"), grad_norm)
    return loss_sum, grad_norm


# ---------------------------------------------------------------------------------------------- checkpoint
def save_checkpoint(step, data_position):
    """Every stage writes its own layers with DCP, keyed by the whole model's names (fsdp2_pretrain.py's format)."""
    partial_dir = checkpoint_root / f".partial_step_{step}"
    if rank == 0:
        shutil.rmtree(partial_dir, ignore_errors=True)
        partial_dir.mkdir(parents=True)
        torch.save({"step": step, "data_position": data_position, "rng": torch.get_rng_state(),
                    "eval_owed": eval_owed}, partial_dir / "train_state.pt")  # one copy: ranks seed alike
    dist.barrier()  # the folder exists before anyone writes into it
    # Replicas and the tied weight's two copies hold the same tensors under the same names: DCP writes each once.
    dcp.save(get_model_state_dict(model), checkpoint_id=partial_dir / "model")
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=partial_dir / "optimizer")
    if rank == 0:
        checkpoints.commit_checkpoint(partial_dir, args, SCRIPT, step, world_size, data_order, RESUMED_BY,
                                      train.chat_format)
    dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is committed


def load_checkpoint(checkpoint_dir):
    """DCP loads in place into state dicts of this stage's names only, from a checkpoint of any layout; we set them."""
    model_state, optimizer_state = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    dcp.load(model_state, checkpoint_id=checkpoint_dir / "model")
    # Only the moments: the saved param groups are one stage's (DCP keeps one copy of what every rank names alike).
    dcp.load({"state": optimizer_state["state"]}, checkpoint_id=checkpoint_dir / "optimizer")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    train_state = torch.load(checkpoint_dir / "train_state.pt", map_location="cpu", weights_only=True)
    torch.set_rng_state(train_state["rng"])
    return train_state["step"], train_state["data_position"], train_state["eval_owed"]


# ---------------------------------------------------------------------------------------------- resume
step, data_position, eval_owed = 0, {"epoch": 0, "index": 0}, False
if resume_dir is not None:
    step, data_position, eval_owed = load_checkpoint(resume_dir)
    optimizer.param_groups[0]["weight_decay"] = args.weight_decay  # the load restored the checkpoint's: this run's wins
    if rank == 0:
        print(f"resumed from {resume_dir} at step {step}")


def make_schedule(split, epoch, grad_accum, order):  # a split's epoch (a mixture's: each source its token share)
    return data.epoch_schedule(split.lengths, args.buckets, args.tokens_per_batch, dp_size, grad_accum, args.seed,
                               epoch, order, data.epoch_samples(split, args.seed, epoch))


# ---------------------------------------------------------------------------------------------- evaluation
val_schedules = {name: make_schedule(split, 0, args.grad_accum, "ascending") for name, split in val.items()}


@torch.no_grad()
def evaluate():
    """Loss over each source's validation split (summed over all its tokens on all ranks, then divided once), and over
    them all (val_loss: their token-weighted mean)."""
    model.eval()
    loss_sums = torch.zeros(len(val), device=device)
    for i, (name, schedule) in enumerate(val_schedules.items()):
        for bucket_len, samples in schedule:
            batch_size = data.bucket_batch_size(args.tokens_per_batch, bucket_len)
            batches = [data.collate(val[name], samples[micro * dp_size + dp_rank::dp_size * args.grad_accum],
                                    bucket_len, batch_size, device) for micro in range(args.grad_accum)]
            loss_sums[i] += run_pipeline(batches, 1.0, train=False)  # summed (last stage)
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
    batches = [data.collate(train, step_samples[micro * dp_size + dp_rank::dp_size * args.grad_accum], bucket_len,
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
    padded_tokens = dp_size * args.grad_accum * batch_size * bucket_len
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
