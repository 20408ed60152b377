"""Pretrain a Qwen2-architecture LM on one mesh: FSDP2 replicated across nodes (HSDP) x context x tensor parallelism.

    torchrun --standalone --nproc_per_node=2 fsdp2_3d_pretrain.py             # default: every degree 1, so FSDP2
    torchrun --standalone --nproc_per_node=8 fsdp2_3d_pretrain.py --dp-replicate 2 --cp 2 --tp 2   # every dimension 2
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=NODE0:29500 fsdp2_3d_pretrain.py \
        --model qwen2-0.5b --data data/fineweb-edu --dp-replicate 2 --tp 2   # per node: 4 shards x tp 2; 2 replicas

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
import transformers
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
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
parser.add_argument("--reshard-after-forward", type=common.boolean, default=True, help="true: a layer's gathered "
                    "parameters are freed after forward, gathered again in backward (ZeRO-3); false: kept (ZeRO-2)")
parser.add_argument("--dp-replicate", type=common.COUNT, default=1, help="FSDP2's replicas (HSDP; typically the "
                    "nodes): each shards the model over world size / (dp-replicate x tp) ranks")
parser.add_argument("--cp", type=common.COUNT, default=1, help="context-parallel degree: the ranks that split each "
                    "sequence")
parser.add_argument("--tp", type=common.COUNT, default=1, help="tensor-parallel degree: the ranks that split each "
                    "decoder layer's matrices")
args = common.parse_args(parser, PRESETS)  # the flags left unset: the --model preset's
heads, kv_heads = (common.MODEL_PRESETS[args.model]["model"][key] for key in ("num_attention_heads",
                                                                              "num_key_value_heads"))
if heads % args.tp or kv_heads % args.tp:  # each tp rank computes whole KV heads (and their query heads)
    raise common.UsageError(f"--tp {args.tp} does not divide the {heads} heads and {kv_heads} KV heads of the "
                            f"'{args.model}' preset: choose a --tp that does")
if world_size % (args.dp_replicate * args.cp * args.tp):
    raise common.UsageError(f"--dp-replicate {args.dp_replicate} x --cp {args.cp} x --tp {args.tp} does not divide the "
                            f"world size {world_size}: choose degrees whose product does")
if any(bucket_len % (2 * args.cp) for bucket_len in args.buckets):  # each sequence is cut into 2 x cp equal chunks
    raise common.UsageError(f"--buckets {','.join(map(str, args.buckets))}: every bucket length must be a multiple of "
                            f"2 x --cp = {2 * args.cp}: change --buckets or --cp")
if args.compile and args.cp * args.tp > 1:  # as in fsdp2_cp_pretrain.py and fsdp2_tp_pretrain.py: eager only
    raise common.UsageError("--compile: this script runs context- and tensor-parallel layers eager; drop --compile or "
                            "set --cp 1 --tp 1")
dp_shard = world_size // (args.dp_replicate * args.cp * args.tp)
dp_size = args.dp_replicate * dp_shard  # the ranks that read different samples
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
# Outermost the slowest links: replicas (across nodes) exchange one gradient all-reduce per layer and step; shards
# gather every layer twice a step; cp ranks gather keys and values every layer; tp ranks all-reduce twice per layer and
# pass, so they are neighbours. Ranks 0..tp-1 are one tp group, cp groups step by tp, and so on.
# Two views of that grid, unflattened from one flat mesh (torch deprecates slicing flattened dimensions out of a root
# mesh): how ranks read (dp: those that read different samples; a cp x tp group reads alike), and how they hold the
# weights (FSDP2 shards over shard_cp, dp_shard x cp: a cp group holds the same ones).
world = init_device_mesh(device.type, (world_size,), mesh_dim_names=("world",))
data_mesh = world._unflatten(0, (dp_size, args.cp, args.tp), ("dp", "cp", "tp"))
weight_mesh = world._unflatten(0, (args.dp_replicate, dp_shard * args.cp, args.tp), ("replicate", "shard_cp", "tp"))
dp_rank, cp_rank, tp_rank = (data_mesh[name].get_local_rank() for name in ("dp", "cp", "tp"))
cp_group, dp_cp_group = data_mesh["cp"].get_group(), data_mesh["dp", "cp"]._flatten("dp_cp").get_group()  # tokens

# ---------------------------------------------------------------------------------------------- model
torch.manual_seed(args.seed)  # the same init on every rank, and in every script
model = modeling.build_model(args.model, args.activation_checkpointing, args.loss_chunk_rows, fake)
if init_dir is not None:  # midtraining: a checkpoint's weights, whole on every rank; the optimizer starts fresh
    dcp.load(model.state_dict(), checkpoint_id=init_dir / "model")  # in place: a state_dict's tensors are the weights
n_params, model_config = model.num_parameters(), model.config  # transformers' count: a tied weight once
if rank == 0:
    common.write_config(args, SCRIPT, world_size, device, dtype, n_params, tokens_per_step, resume_dir or init_dir)
if args.compile:  # --cp 1 --tp 1 only (the check above)
    torch._dynamo.config.recompile_limit = 2 * len(args.buckets)  # per bucket a training and an evaluation graph
    for layer in model.model.layers.children():  # regional: all layers share each bucket's graph; hooks stay outside
        layer.compile(dynamic=False)  # in place (state_dict keys unchanged); static shapes: each bucket its own kernels

# ---------------------------------------------------------------------------------------------- context parallel
# A cp group cuts each sequence into 2 x cp chunks; rank r takes chunks r and 2cp-1-r (ring-flash-attention's zigzag).
# Under the causal mask chunk i attends to i + 1 chunks, so every rank gets the same share of the triangle (Llama 3,
# section 3.3.2); cut into cp pieces, the last rank would attend to cp times the keys of the first, and the first wait.
def zigzag_split(tensor, rank):
    """Cp rank RANK's share of the last dimension (the sequence): chunks rank and 2cp-1-rank of 2 x cp, in order."""
    chunks = tensor.chunk(2 * args.cp, dim=-1)
    return torch.cat([chunks[rank], chunks[2 * args.cp - 1 - rank]], dim=-1)


class GatherSequence(torch.autograd.Function):
    """The cp ranks' pieces of a tensor, concatenated along the sequence (dim -2) in rank order, on every cp rank.
    Backward: every rank's queries gave a gradient to every key and value; summed over the group, each keeps its own."""

    @staticmethod
    def forward(ctx, piece):
        pieces = [torch.empty_like(piece) for _ in range(args.cp)]
        dist.all_gather(pieces, piece.contiguous(), group=cp_group)
        return torch.cat(pieces, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place: not on autograd's buffer
        dist.all_reduce(grad, group=cp_group)  # gloo has no reduce-scatter: the sum everywhere, then this rank's slice
        return grad.chunk(args.cp, dim=-2)[cp_rank]


def context_parallel_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               position_ids=None, **kwargs):
    """transformers' attention interface, as sdpa_attention_forward: this rank's queries [batch, heads, its positions,
    head dim] attend to the keys and values of the whole sequence; returns [batch, positions, heads, head dim], None."""
    # All-gather, Llama 3's choice over ring attention: with 2 KV heads (qwen2-0.5b: 14 query heads) it moves little.
    key_value = GatherSequence.apply(torch.stack([key, value]))  # [2, batch, KV heads, whole sequence, head dim]
    key, value = key_value.repeat_interleave(module.num_key_value_groups, dim=2)  # each KV head serves its query heads
    # attention_mask is None: transformers makes masks for its own implementations only. Ours, by global positions:
    key_positions = torch.cat([zigzag_split(torch.arange(key.shape[-2], device=key.device), r) for r in range(args.cp)])
    causal = position_ids[0, :, None] >= key_positions  # [this rank's positions, the whole sequence in gathered order]
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=causal, dropout_p=dropout,
                                                              scale=scaling)
    return output.transpose(1, 2), None


# No patch: the model class stays transformers' own, and its attention layers look this function up by name.
# torch's experimental context_parallel() (CUDA) instead swaps SDPA for ring attention inside a context manager; it has
# no sharding rule for CPU's SDPA kernel (aten._scaled_dot_product_flash_attention_for_cpu), so it cannot run on gloo.
transformers.AttentionInterface.register("context_parallel", context_parallel_attention)
if args.cp > 1:  # cp 1: transformers' own causal SDPA (the fused kernels), no all-gather over one rank
    model.config._attn_implementation = "context_parallel"

# ---------------------------------------------------------------------------------------------- tensor parallel
# fsdp2_tp_pretrain.py's plan, over the tp dimension: q, k, v, gate and up split by output features (whole heads), o and
# down by input features; the embedding, norms and tied head stay whole on every tp rank. Attention above then sees
# this rank's heads only: the cp all-gather moves 1/tp of the keys and values.
layer_plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
              "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
              "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
for layer in model.model.layers if args.tp > 1 else []:  # tp 1: plain tensors, no DTensor on a mesh of one rank
    parallelize_module(layer, weight_mesh["tp"], layer_plan)

# ---------------------------------------------------------------------------------------------- wrap
# bf16: compute on bf16 copies of the gathered parameters; reduce gradients and keep the shards in fp32.
mixed_precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
# HSDP: a 2D mesh, shards over shard_cp, each shard replicated over the replicas (gradients reduce-scattered within
# a replica, then all-reduced across replicas); with one replica, FSDP2's 1D mesh. TP's shards are split again.
fsdp_mesh = weight_mesh["replicate", "shard_cp"] if args.dp_replicate > 1 else weight_mesh["shard_cp"]
for layer in model.model.layers:  # one unit per decoder layer: only one layer is ever gathered at a time
    fully_shard(layer, mesh=fsdp_mesh, mp_policy=mixed_precision, reshard_after_forward=args.reshard_after_forward)
fully_shard(model, mesh=fsdp_mesh, mp_policy=mixed_precision)  # the root: embedding, tied head, final norm
# A local shard's share of the norm: 1 / the ranks holding it, those along its mesh's Replicate dimensions and off it.
norm_shares = torch.tensor([p.device_mesh.size() / world_size / math.prod(size for size, placement in zip(
    p.device_mesh.shape, p.placements) if placement.is_replicate()) for p in model.parameters()], device=device)

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
        positions = zigzag_split(torch.arange(input_ids.shape[-1], device=device), cp_rank)  # each token's place
        # The targets are already shifted (position t's is token t+1), so a rank's piece scores its own predictions.
        input_ids, targets = zigzag_split(input_ids, cp_rank), zigzag_split(targets, cp_rank)
        # Divide by the target tokens of the WHOLE step (all ranks, all micro-batches), not by this batch's:
        # a long sample then weighs as much as it would in one big batch. The gradient sync averages over
        # FSDP2 mesh (replicas, shards and cp ranks: tp ranks share tokens), so we multiply by its size for the sum.
        model.set_requires_gradient_sync(micro == len(batches) - 1)  # FSDP2's switch for no_sync()
        # The summed loss; logits only at target positions, a chunk at a time (modeling.Qwen2WithChunkedLoss).
        micro_loss_sum = model(input_ids=input_ids, targets=targets,
                               position_ids=positions[None])  # rotary: each token at its true position
        (micro_loss_sum * fsdp_mesh.size() / target_tokens).backward()
        loss_sum += micro_loss_sum.detach()
    # Every gradient's norm in one foreach kernel, in fp64: on a CPU fp32 drifts ~1e-4 on big tensors (pytorch#169237).
    # Over local shards (DTensors on two meshes cannot be stacked, pytorch#180346), each squared norm times its share.
    local_grads = [p.grad.to_local() for p in model.parameters()]
    norms = torch._foreach_norm(local_grads, 2, torch.float64)
    grad_norm = (torch.stack(norms).square() * norm_shares).sum()
    dist.all_reduce(grad_norm)
    grad_norm = grad_norm.sqrt().float()
    # Clipped as clip_grads_with_norm_ does, the local shards in one foreach kernel (DTensors on two meshes: op by op).
    torch._foreach_mul_(local_grads, ((args.grad_clip or float("inf")) / (grad_norm + 1e-6)).clamp(max=1.0))
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
    optimizer.param_groups[0]["weight_decay"] = args.weight_decay  # the load restored the checkpoint's: this run's wins
    if rank == 0:
        print(f"resumed from {resume_dir} at step {step}")


def make_schedule(split, epoch, grad_accum, order):  # a split's epoch (a mixture's: each source its token share)
    return data.epoch_schedule(split.lengths, args.buckets, args.tokens_per_batch, dp_size, grad_accum, args.seed,
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
            input_ids, targets = data.collate(val[name], samples[dp_rank::dp_size], bucket_len, batch_size, device)
            input_ids, targets = zigzag_split(input_ids, cp_rank), zigzag_split(targets, cp_rank)
            positions = zigzag_split(torch.arange(bucket_len, device=device), cp_rank)  # each token's true position
            loss_sums[i] += model(input_ids=input_ids, targets=targets,
                                  position_ids=positions[None])  # summed over this rank's targets
    dist.all_reduce(loss_sums, group=dp_cp_group)  # each token's loss once: its tp ranks all hold it
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
    # Over all ranks, tp rank 0's loss alone (its tp ranks share it: torchtitan sums over dp_cp), and any signal.
    step_sums = torch.stack([loss_sum * (tp_rank == 0), loss_sum.new_full((), len(stop_signals))])
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
