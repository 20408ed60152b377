"""Pretrain a Mixture of Experts (Qwen2-MoE) with expert parallelism and FSDP2: tokens sent to experts by all-to-all.

    torchrun --standalone --nproc_per_node=2 fsdp2_ep_pretrain.py             # default: small-moe, ep = world size
    torchrun --standalone --nproc_per_node=8 fsdp2_ep_pretrain.py --model qwen2-0.5b-moe --ep 8 --data data/fineweb-edu
qwen2-0.5b-moe: 2,138,450,816 parameters, 404,368,256 of them active per token (qwen2-0.5b: 402,970,496).

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
import torch.nn.functional as F
import transformers
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import checkpoints
import common
import data
import metrics
import modeling

SCRIPT = Path(__file__).stem  # names the run folder and is recorded in every checkpoint
# The scripts that resume its checkpoints (recorded in each): the same format and data order.
RESUMED_BY = [SCRIPT]
# Each --model preset's training defaults: the values of the flags left unset (its shape: modeling.MOE_PRESETS).
PRESETS = {
    "tiny-moe": dict(buckets=[32, 64, 128], tokens_per_batch=512, lr=3e-3, warmup_steps=5, max_steps=20,
                     eval_every=10, save_every=10),
    "small-moe": dict(buckets=[32, 64, 128, 256], tokens_per_batch=1024, lr=3e-3, warmup_steps=10,
                      max_steps=60, eval_every=20, save_every=20),
    "qwen2-0.5b-moe": dict(buckets=[256, 512, 1024, 2048], tokens_per_batch=65536, lr=3e-4, warmup_steps=200,
                           max_steps=5000, eval_every=250, save_every=500),
}

# ---------------------------------------------------------------------------------------------- setup
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
parser = common.get_parser(__doc__, f"runs/{SCRIPT}", PRESETS)
parser.set_defaults(model="small-moe")
common.add_batch_arguments(parser)  # --grad-accum, --bucket-order
parser.add_argument("--data", nargs="+", default=["data/builtin"], help="prepared folders, or FOLDER:WEIGHT ...")
parser.add_argument("--init-from", default=None, help="start from the weights of a checkpoint this script resumes (a "
                    "checkpoint folder, or a run folder: its newest) at step 0, with a fresh optimizer and schedule "
                    "(default: none, the model's own init)")
parser.add_argument("--reshard-after-forward", type=common.boolean, default=True, help="true: a layer's gathered "
                    "parameters are freed after forward, gathered again in backward (ZeRO-3); false: kept (ZeRO-2)")
parser.add_argument("--ep", type=common.COUNT, default=None, help="expert-parallel degree: the ranks that split each "
                    "layer's experts (default: the world size); each expert is FSDP2-sharded over world / ep ranks")
parser.add_argument("--aux-loss-coef", type=common.NON_NEGATIVE, default=0.01, help="weight of the load-balancing loss "
                    "(Switch Transformer's) beside the mean token loss; 0: none")
args = common.parse_args(parser, PRESETS)  # the flags left unset: the --model preset's
args.ep = args.ep or world_size
n_experts, top_k = (modeling.MOE_PRESETS[args.model][1][key] for key in ("num_experts", "num_experts_per_tok"))
if world_size % args.ep or n_experts % args.ep:  # each rank holds the same number of whole experts
    raise common.UsageError(f"--ep {args.ep} must divide the world size {world_size} and the {n_experts} experts of "
                            f"'{args.model}': choose an --ep that divides both")
tokens_per_step = args.tokens_per_batch * args.grad_accum * world_size  # positions a step computes, padding too
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
# Ranks 0..ep-1 share out the experts (an all-to-all group: neighbours, as it moves the most); the dp ranks, one in each
# group, hold the same experts. Unflattened from one flat mesh (torch deprecates slicing flattened dimensions).
world = init_device_mesh(device.type, (world_size,), mesh_dim_names=("world",))
expert_mesh = world._unflatten(0, (world_size // args.ep, args.ep), ("dp", "ep"))
ep_group, ep_rank = expert_mesh["ep"].get_group(), expert_mesh["ep"].get_local_rank()

# ---------------------------------------------------------------------------------------------- model
torch.manual_seed(args.seed)  # the same init on every rank, and in every script
model = modeling.build_moe_model(args.model, args.activation_checkpointing, args.loss_chunk_rows, fake)
if init_dir is not None:  # midtraining: a checkpoint's weights, whole on every rank; the optimizer starts fresh
    dcp.load(model.state_dict(), checkpoint_id=init_dir / "model")  # in place: a state_dict's tensors are the weights
n_params, model_config = model.num_parameters(), model.config  # transformers' count: a tied weight once
n_active = n_params - sum(p.numel() for name, p in model.named_parameters() if "experts." in name) * (
    n_experts - top_k) // n_experts  # a token's: the experts it is not routed to do not count
if rank == 0:
    common.write_config(args, SCRIPT, world_size, device, dtype, n_params, tokens_per_step, resume_dir or init_dir)
if args.compile:
    torch._dynamo.config.recompile_limit = 2 * len(args.buckets)  # per bucket a training and an evaluation graph
    for layer in model.model.layers.children():  # regional: all layers share each bucket's graph; hooks stay outside
        layer.self_attn.compile(dynamic=False)  # attention only: the experts' shapes hang on the routing

# ---------------------------------------------------------------------------------------------- expert parallel
all_to_all_bytes = torch.zeros((), dtype=torch.float64)  # what this rank sends to others in the step's forward passes


def all_to_all_experts(experts, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface, called after the router: this rank's tokens [tokens, hidden] go to the ranks
    holding their top-k experts, are run there and come back, summed with their routing weights. Dropless."""
    # 1. The (token, expert) pairs sorted by expert: each rank's rows, and each of its experts', in one block.
    order = top_k_index.flatten().argsort(stable=True)
    sent_counts = torch.histc(top_k_index.float(), n_experts, 0, n_experts).long()  # rows to each expert (no wait)
    # 2. The counts exchanged: each rank learns the rows it receives from every rank for each of its experts.
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=ep_group)  # [ep ranks x experts a rank]
    if fake:  # estimate_memory.py's fake tensors hold no counts: every rank sends every expert the same rows
        sent_counts = received_counts = torch.full((n_experts,), len(order) // n_experts, device=device)
    send_splits, receive_splits = (c.view(args.ep, -1).sum(1).tolist() for c in (sent_counts, received_counts))  # wait
    # 3. The tokens, in uneven splits (the autograd form: backward sends the gradients the reverse way).
    received = all_to_all_single_autograd(hidden_states[order // top_k], receive_splits, send_splits, ep_group)
    # 4. The owner runs its experts: the rows, by (source rank, expert), regrouped by expert; each expert its matmuls.
    expert_of_row = torch.arange(n_experts, device=device).repeat_interleave(received_counts) % (n_experts // args.ep)
    by_expert = expert_of_row.argsort(stable=True)
    gate_up_proj, down_proj = experts.gate_up_proj.to_local(), experts.down_proj.to_local()  # this rank's experts
    outputs = []
    for expert, rows in enumerate(received[by_expert].split(received_counts.view(args.ep, -1).sum(0).tolist())):
        gate, up = F.linear(rows, gate_up_proj[expert]).chunk(2, dim=-1)  # an expert with no rows too: a gradient
        outputs.append(F.linear(experts.act_fn(gate) * up, down_proj[expert]))
    outputs = torch.cat(outputs)[by_expert.argsort()]  # back in (source rank, expert) order
    # 5. The reverse exchange; each token's k results weighted by the router and summed.
    returned = all_to_all_single_autograd(outputs, send_splits, receive_splits, ep_group)
    rows = sum(send_splits) - send_splits[ep_rank] + sum(receive_splits) - receive_splits[ep_rank]  # to others, there
    all_to_all_bytes.add_(rows * hidden_states[0].nbytes)  # and back (a recompute in backward counts again)
    weighted = returned * top_k_weights.flatten()[order, None].to(returned.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, order // top_k, weighted)


routing = []  # each router's (logits, weights, top-k choices) in this rank's forward, for the balance loss


def keep_routing(router, inputs, output):  # the forward's: not a recompute's in backward, nor evaluation's
    if torch.is_grad_enabled() and len(routing) < len(model.model.layers):
        routing.append(output)


# No patch: the model class stays transformers' own, and its experts look this function up by the config's name.
transformers.integrations.moe.ExpertsInterface.register("all_to_all", all_to_all_experts)
model.config._experts_implementation = "all_to_all"  # on one process too: the reference runs the same code
for layer in model.model.layers:
    layer.mlp.gate.register_forward_hook(keep_routing)
    for name, weight in list(layer.mlp.experts.named_parameters()):  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
        layer.mlp.experts.register_parameter(name, torch.nn.Parameter(  # this rank's experts: a DTensor, same name
            distribute_tensor(weight.data, expert_mesh["ep"], [Shard(0)])))  # Shard(0) over ep

# ---------------------------------------------------------------------------------------------- wrap
# bf16: compute on bf16 copies of the gathered parameters; reduce gradients and keep the shards in fp32.
mixed_precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
for layer in model.model.layers:  # one unit per decoder layer: only one layer is ever gathered at a time
    # The experts first, their own unit: dim 0 (experts) split over ep already, FSDP2 shards each expert on dim 1 over
    # the dp ranks that share it (on dim 0, dp ranks beyond a rank's experts would hold nothing).
    fully_shard(layer.mlp.experts, mesh=expert_mesh["dp"], mp_policy=mixed_precision,
                reshard_after_forward=args.reshard_after_forward, shard_placement_fn=lambda weight: Shard(1))
    # Their gradient sums all ep ranks' tokens: divide by the world size, not by FSDP2's dp ranks (ep times too big).
    layer.mlp.experts.set_gradient_divide_factor(world_size)
    # A sum, then the division: gloo has no PREMUL_SUM. Not on one dp rank, where torch 2.13 would divide twice.
    layer.mlp.experts.set_force_sum_reduction_for_comms(args.ep < world_size)
    fully_shard(layer, mp_policy=mixed_precision, reshard_after_forward=args.reshard_after_forward)
fully_shard(model, mp_policy=mixed_precision)  # the root: embedding, tied head, final norm; default mesh: all ranks

# ---------------------------------------------------------------------------------------------- optimizer
# Matrices decay; biases and norm gains do not: decided by name, the same rule in every script.
decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "norm" in name)]
no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "norm" in name]
groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


# ---------------------------------------------------------------------------------------------- training step
def balance_loss(is_target):
    """This rank's share of the micro-batch's load-balancing loss over ALL ranks' tokens with a target (Switch's, mean
    over layers): E x sum_e f_e P_e, f_e expert e's share of the top-k choices (no gradient), P_e its mean probability.
    The ranks' shares add up to one process's loss; per rank, each rank's batch would have to balance on its own, a
    stronger constraint that changes with the world size. Also returns each layer's tokens per expert, all ranks'."""
    weights = is_target.flatten()[:, None].float()
    counts = torch.stack([torch.zeros(n_experts, device=device).index_add_(0, choices.flatten(), weights.expand_as(
        choices).flatten()) for *_, choices in routing])  # each expert's count of top-k choices
    dist.all_reduce(counts)  # [layers, experts]: the micro-batch's routing on every rank
    choices = counts.sum(1, keepdim=True)  # top-k x the tokens with a target, in each layer
    probabilities = torch.stack([(logits.float().softmax(-1) * weights).sum(0) for logits, *_ in routing])
    return n_experts * (counts / choices * probabilities / (choices / top_k)).sum(1).mean(), counts


def train_step(batches, target_tokens):
    """Forward and backward over this rank's micro-batches [(input_ids, targets)] of a step with target_tokens targets
    on all ranks; the gradients clipped. Returns this rank's summed loss, the global gradient norm, this rank's share of
    the balance loss and every layer's tokens per expert."""
    loss_sum = torch.zeros((), device=device)
    aux_loss, expert_counts = torch.zeros((), device=device), 0
    for micro, (input_ids, targets) in enumerate(batches):
        # Divide by the target tokens of the WHOLE step (all ranks, all micro-batches), not by this batch's:
        # a long sample then weighs as much as it would in one big batch. The gradient sync averages over
        # ranks, so we multiply by world_size to turn that average back into the sum.
        model.set_requires_gradient_sync(micro == len(batches) - 1)  # FSDP2's switch for no_sync()
        # The summed loss; logits only at target positions, a chunk at a time (modeling.Qwen2WithChunkedLoss).
        routing.clear()
        micro_loss_sum = model(input_ids=input_ids, targets=targets)
        micro_aux_loss, micro_counts = balance_loss(targets != common.IGNORE_INDEX)  # each micro-batch balanced
        ((micro_loss_sum / target_tokens + args.aux_loss_coef * micro_aux_loss / len(batches)) * world_size).backward()
        loss_sum += micro_loss_sum.detach()
        aux_loss, expert_counts = aux_loss + micro_aux_loss.detach() / len(batches), expert_counts + micro_counts
    # Every gradient's norm in one foreach kernel, in fp64: on a CPU fp32 drifts ~1e-4 on big tensors (pytorch#169237).
    local_grads = [p.grad.to_local() for p in model.parameters()]  # shards: DTensors on two meshes cannot be stacked
    grad_norm = torch.stack(torch._foreach_norm(local_grads, 2, torch.float64)).square().sum()
    dist.all_reduce(grad_norm)  # each element lives on one rank: the ranks' squares add up
    grad_norm = grad_norm.sqrt().float()
    # Clipped as clip_grads_with_norm_ does, the local shards in one foreach kernel (DTensors on two meshes: op by op).
    torch._foreach_mul_(local_grads, ((args.grad_clip or float("inf")) / (grad_norm + 1e-6)).clamp(max=1.0))
    return loss_sum, grad_norm, aux_loss, expert_counts


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
    all_to_all_bytes.zero_()
    loss_sum, grad_norm, aux_loss, expert_counts = train_step(batches, target_tokens)
    step_sums = torch.stack([loss_sum, loss_sum.new_full((), len(stop_signals)), aux_loss])  # a rank's signal stops all
    dist.all_reduce(step_sums)  # for the log and the check (the gradients were already exact), and the stop
    loss_sum, stop_votes, aux_loss, grad_norm = torch.cat([step_sums, grad_norm[None]]).tolist()  # the step's one wait
    expert_load = (expert_counts.max(1).values / expert_counts.mean(1)).tolist()  # per layer: 1 is perfectly balanced
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
    flops = modeling.flops_per_token(n_active, model_config, bucket_len) * tokens  # MFU on the active parameters
    mfu = flops / step_time / (peak_flops * world_size) if peak_flops else None  # None where the peak is unknown (CPUs)
    if step % args.log_every == 0 or step == args.max_steps:
        log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
             "padded_tokens": padded_tokens, "target_tokens": target_tokens, "bucket_len": bucket_len,
             "batch_size": batch_size, "tokens_per_s": tokens / step_time,
             "mfu": mfu, "peak_mem_gb": step_peak_mem_gb, "peak_reserved_gb": step_peak_reserved_gb,
             "elapsed_s": time.perf_counter() - start_time, "aux_loss": aux_loss,
             "all_to_all_mb": all_to_all_bytes.item() / 1e6,  # this rank's sends in the step's forward passes
             **{f"expert_load/{layer}": load for layer, load in enumerate(expert_load)}})
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
