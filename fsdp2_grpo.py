"""Reinforce the finetuned model with FSDP2 from verifiable rewards (GRPO-style): sample replies, reward right answers.

    torchrun --standalone --nproc_per_node=2 fsdp2_grpo.py                    # after fsdp2_sft.py; data/builtin-rl
    torchrun --standalone --nproc_per_node=8 fsdp2_grpo.py --model qwen2-0.5b --data data/gsm8k

--data: a folder of prepare_data.py (`python prepare_data.py` writes data/builtin-rl; its docstring says how to write
data/gsm8k). The model starts from runs/fsdp2_sft's newest checkpoint unless --init-from names another.
"""
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import checkpoints
import common
import data
import grading
import metrics
import modeling

SCRIPT = Path(__file__).stem  # names the run folder and is recorded in every checkpoint
# The scripts that resume its checkpoints (recorded in each): the same format and data order.
RESUMED_BY = [SCRIPT]
# What --init-from reads: a model/ folder of DCP shards (the FSDP2 layout) or an export_hf.py folder.
STARTS_FROM = ["fsdp2_sft", "fsdp2_grpo", "fsdp2_pretrain", "fsdp2_tp_pretrain", "fsdp2_cp_pretrain", "pp_pretrain",
               "fsdp2_3d_pretrain", "fsdp2_muon_pretrain", "export_hf"]
# Each --model preset's training defaults: the values of the flags left unset (its shape: common.MODEL_PRESETS).
PRESETS = {
    "tiny": dict(buckets=[72], tokens_per_batch=512, lr=1e-4, warmup_steps=2, max_steps=20, eval_every=10,
                 save_every=10, prompts_per_step=1, eval_generate=16),
    # A bucket holds a prompt and its worked reply (about 75 tokens), a rank's 64 replies a step one micro-batch;
    # 30 steps: what docs/rl.md's run needs to reach its held-out accuracy.
    "small": dict(buckets=[96], tokens_per_batch=6144, lr=1e-4, min_lr_ratio=1.0, warmup_steps=5, max_steps=30,
                  eval_every=15, save_every=15, prompts_per_step=8, eval_generate=200),
    "qwen2-0.5b": dict(buckets=[4096], tokens_per_batch=16384, lr=1e-6, warmup_steps=10, max_steps=500, eval_every=50,
                       save_every=100, prompts_per_step=8, eval_generate=200),
}

# ---------------------------------------------------------------------------------------------- setup
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
parser = common.get_parser(__doc__, f"runs/{SCRIPT}")
parser.add_argument("--data", default="data/builtin-rl", help="a folder of problems (prepare_data.py --sft)")
parser.add_argument("--init-from", default="runs/fsdp2_sft", help="the checkpoint to start from: a checkpoint "
                    "folder, a run folder (its newest) or an export_hf.py folder")
parser.add_argument("--reshard-after-forward", type=common.boolean, default=True, help="true: a layer's gathered "
                    "parameters are freed after forward, gathered again in backward (ZeRO-3); false: kept (ZeRO-2)")
parser.add_argument("--eval-generate", type=common.NON_NEGATIVE_INT, default=None,
                    help="held-out problems answered by greedy generation at each evaluation (answer accuracy)")
parser.add_argument("--group-size", type=common.number(int, 2), default=8, help="replies sampled per prompt "
                    "and rewarded against each other (a lone reply has no group: its advantage is always 0)")
parser.add_argument("--prompts-per-step", type=common.COUNT, default=None, help="prompts per rank per optimizer step")
parser.add_argument("--reward", choices=grading.REWARDS, default="exact-text", help="a reply's answer, compared with "
                    "the reference's: exact-text, the text between its solution markers (as evaluate.py scores it); "
                    "final-number, the last number between them (else in the whole reply), for data such as GSM8K")
args = common.parse_args(parser, PRESETS)  # the flags left unset: the --model preset's
rows = args.tokens_per_batch // args.buckets[-1]  # a step's positions: its rollouts, in batches of this many rows
tokens_per_step = -(-args.prompts_per_step * args.group_size // rows) * rows * args.buckets[-1] * world_size
args = common.finalize_args(args, tokens_per_step)
run_folder_lock = common.lock_folder(args.out_dir, "--out-dir") if rank == 0 else None  # one writer, until exit
stop_signals = common.note_stop_signals()  # SIGTERM, SIGINT, SIGUSR1: this rank's, until the step's end
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
fake = args.estimate_memory == "fake"  # estimate_memory.py's: fake tensors on a fake process group, shapes only
checkpoint_root = Path(args.out_dir) / "checkpoints"
resume_dir = checkpoints.find_resume_checkpoint(args, checkpoint_root, SCRIPT)
init_dir = None if resume_dir or args.estimate_memory else checkpoints.find_init_checkpoint(args, STARTS_FROM)
init_meta = checkpoints.read_meta(init_dir, "--init-from") if init_dir else None
if init_meta and not init_meta.get("chat_format"):  # the policy answers in the chat format: it must know it
    raise common.UsageError(f"--init-from {init_dir} was written by {init_meta['script']}.py (its model never learned "
                            f"the chat format and its markers): start from a fsdp2_sft.py checkpoint")

# ---------------------------------------------------------------------------------------------- data
tokenizer = common.get_chat_tokenizer()  # GPT-2 BPE plus the role and reasoning markers
# Problems with reference answers (a conversation's reply, or a bare answer): the prompts and their answers.
train, val = data.load_sft_data(args)
# What the sample order depends on (checked: enough samples); a step takes prompts_per_step prompts on each rank.
data_order = data.data_order(args, train, val, world_size, [args.prompts_per_step], ["prompts_per_step"], "shuffled")
checkpoints.check_resume(resume_dir, args, data_order)  # --resume: the same data order; says which other flags changed
# A prompt is a conversation up to its last <|assistant|>; its answer, the reference reply's as --reward reads it.
train_prompts, train_answers, _ = grading.answer_prompts(tokenizer, train, len(train.lengths), args.reward)
if not train_prompts:
    where = "between <|begin_of_solution|> and <|end_of_solution|>" + ", or a number" * (args.reward == "final-number")
    raise common.UsageError(f"--reward {args.reward} finds no answer in any reference reply of --data {args.data} "
                            f"({where}): nothing can be rewarded; check --data and --reward")
if args.prompts_per_step * world_size > len(train_prompts):  # each rank samples prompts_per_step x group_size replies
    raise common.UsageError(f"--prompts-per-step {args.prompts_per_step}: at most {len(train_prompts) // world_size:,} "
                            f"(the {len(train_prompts):,} training prompts / {world_size} ranks)")

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
n_params, model_config = model.num_parameters(), model.config  # transformers' count: a tied weight once
if rank == 0:
    common.write_config(args, SCRIPT, world_size, device, dtype, n_params, tokens_per_step, resume_dir or init_dir)
if args.compile:
    torch._dynamo.config.recompile_limit = 2 * len(args.buckets)  # per bucket a training and an evaluation graph
    for layer in model.model.layers.children():  # regional: all layers share each bucket's graph; hooks stay outside
        layer.compile(dynamic=False)  # in place (state_dict keys unchanged); static shapes: each bucket its own kernels

# ---------------------------------------------------------------------------------------------- wrap
# bf16: compute on bf16 copies of the gathered parameters; reduce gradients and keep the shards in fp32.
# Inputs keep their dtypes (the layers' are bf16 already): the advantages, passed as weights=, stay fp32.
mixed_precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
for layer in model.model.layers:  # one unit per decoder layer: only one layer is ever gathered at a time
    fully_shard(layer, mp_policy=mixed_precision, reshard_after_forward=args.reshard_after_forward)
fully_shard(model, mp_policy=mixed_precision)  # the root: embedding, tied head, final norm; default mesh: all ranks

# ---------------------------------------------------------------------------------------------- init from a checkpoint
if init_dir is not None and checkpoints.is_hf_folder(init_dir):  # export_hf.py's: whole tensors; each rank keeps shards
    set_model_state_dict(model, checkpoints.hf_state_dict(init_dir), options=StateDictOptions(full_state_dict=True))
elif init_dir is not None:
    model_state = get_model_state_dict(model)  # this rank's shards: DCP reads only those, nothing is gathered
    dcp.load(model_state, checkpoint_id=init_dir / "model")
    set_model_state_dict(model, model_state)

# ---------------------------------------------------------------------------------------------- optimizer
# Matrices decay; biases and norm gains do not: decided by name, the same rule in every script.
decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "norm" in name)]
no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "norm" in name]
groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


# ---------------------------------------------------------------------------------------------- training step
def train_step(batches, target_tokens):
    """Forward and backward over this rank's micro-batches [(input_ids, targets, token_advantages)] of a step with
    target_tokens targets on all ranks; the gradients clipped. Returns this rank's summed loss and the global norm."""
    loss_sum = torch.zeros((), device=device)
    for micro, (input_ids, targets, token_advantages) in enumerate(batches):
        # Divide by the target tokens of the WHOLE step (all ranks, all micro-batches), not by this batch's:
        # a long sample then weighs as much as it would in one big batch. The gradient sync averages over
        # ranks, so we multiply by world_size to turn that average back into the sum.
        model.set_requires_gradient_sync(micro == len(batches) - 1)  # FSDP2's switch for no_sync()
        # The policy gradient, -(advantage x log-probability) summed over the reply tokens (the targets), each token
        # weighed by its reply's advantage: raise the log-probability of replies better than their group's mean, lower
        # the others'. On-policy, one optimizer step per batch of rollouts: no importance ratio, clipping or reference
        # model (reusing rollouts for more steps would bring PPO's ratio and clip back).
        micro_loss_sum = model(input_ids=input_ids, targets=targets,
                               weights=token_advantages.to(device))
        (micro_loss_sum * world_size / target_tokens).backward()
        loss_sum += micro_loss_sum.detach()
    # Every gradient's norm in one foreach kernel, in fp64: on a CPU fp32 drifts ~1e-4 on big tensors (pytorch#169237).
    norms = torch._foreach_norm([p.grad for p in model.parameters()], 2, torch.float64)  # DTensors: each shard's
    grad_norm = torch.stack(norms).square().sum().sqrt().float().full_tensor()  # one all-reduce adds the shards'
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip or float("inf"), grad_norm)
    return loss_sum, grad_norm


if args.estimate_memory:  # estimate_memory.py: this step, measured per bucket on full batches; the process ends there
    metrics.estimate_memory(args, model, optimizer, lambda batches, target_tokens: train_step(  # replies weighed 1
        [(input_ids, targets, torch.ones(targets.shape)) for input_ids, targets in batches], target_tokens), device,
        lambda rows: -(-args.prompts_per_step * args.group_size // rows))  # its micro-batches: all replies, padded


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


def prompt_schedule(epoch):  # all prompts as one bucket of length 1: a step takes prompts_per_step of them per rank
    return data.epoch_schedule(np.ones(len(train_prompts), dtype=np.int64), [1], args.prompts_per_step, world_size, 1,
                               args.seed, epoch)


# ---------------------------------------------------------------------------------------------- evaluation
val_schedules = {name: make_schedule(split, 0, 1, "ascending") for name, split in val.items()}
# Answer accuracy: greedy replies to held-out prompts, checked against the reference as the reward checks them.
val_prompts, val_answers, _ = grading.answer_prompts(tokenizer, next(iter(val.values())), args.eval_generate,
                                                  args.reward)
# A reply may be as long as a rollout's: the bucket less the prompt (a bare reference answer says nothing of it).
max_reply_tokens = args.buckets[-1] - max(map(len, val_prompts), default=0)


@torch.no_grad()
def evaluate():
    """Loss over each source's validation split (summed over all its tokens on all ranks, then divided once), and over
    them all (val_loss: their token-weighted mean); and answer accuracy."""
    model.eval()
    loss_sums = torch.zeros(len(val), device=device)
    for i, (name, schedule) in enumerate(val_schedules.items()):
        for bucket_len, samples in schedule:
            batch_size = data.bucket_batch_size(args.tokens_per_batch, bucket_len)
            input_ids, targets = data.collate(val[name], samples[rank::world_size], bucket_len, batch_size, device)
            loss_sums[i] += model(input_ids=input_ids, targets=targets)  # summed over the targets
    mine = list(range(rank, len(val_prompts), world_size))  # each rank answers its share, in one batch
    prompts = [val_prompts[i] for i in mine]
    replies = modeling.generate_replies(model, prompts, max_reply_tokens, synced=True) if val_prompts else []
    answers = [grading.reply_answer(tokenizer, reply, args.reward) for reply in replies]  # as the reward reads them
    correct = sum(answer == val_answers[i] for i, answer in zip(mine, answers))
    correct = torch.tensor(float(correct), device=device)
    dist.all_reduce(loss_sums)
    dist.all_reduce(correct)
    model.train()
    target_counts = [sum(split.target_counts) for split in val.values()]
    return {"val_loss": loss_sums.sum().item() / sum(target_counts),
            **{f"val_loss/{name}": loss / count for name, loss, count in zip(val, loss_sums.tolist(), target_counts)},
            "val_accuracy": correct.item() / len(val_prompts) if val_prompts else None}


# ---------------------------------------------------------------------------------------------- rollouts
def rollout_split(prompts, replies):
    """The step's rollouts as a Split, as collate reads it: prompt + reply per sample, the reply's tokens targets."""
    tokens = np.array([token for prompt, reply in zip(prompts, replies) for token in prompt + reply], dtype=np.int64)
    mask = np.array([i >= len(prompt) for prompt, reply in zip(prompts, replies) for i in range(len(prompt + reply))],
                    dtype=np.uint8)
    lengths = np.array([len(prompt) + len(reply) for prompt, reply in zip(prompts, replies)], dtype=np.int64)
    return data.Split([tokens], [mask], np.zeros(len(lengths), dtype=np.int64), np.cumsum(lengths) - lengths,
                      lengths, np.array([len(reply) for reply in replies], dtype=np.int64), None, True, "")


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
schedule = prompt_schedule(data_position["epoch"])
bucket_len = args.buckets[-1]  # every rollout is padded to the largest bucket: one shape, one graph under --compile
batch_size = data.bucket_batch_size(args.tokens_per_batch, bucket_len)
# The same number on every rank: each forward is collective.
micro_batches = -(-args.prompts_per_step * args.group_size // batch_size)
start_time, total_tokens, total_padded, run_peak_mem_gb, stop_votes = time.perf_counter(), 0, 0, 0.0, 0
validation = evaluate() if step == 0 or eval_owed else {}  # a stopped run's skipped evaluation is made up
if validation:
    log({"step": step, **validation})
model.train()
while step < args.max_steps and not stop_votes:
    if data_position["index"] >= len(schedule):  # epoch done: the next one reshuffles, as a function of (seed, epoch)
        data_position = {"epoch": data_position["epoch"] + 1, "index": 0}
        schedule = prompt_schedule(data_position["epoch"])
    _, step_prompts = schedule[data_position["index"]]  # the step's prompts, all ranks'
    data_position = {**data_position, "index": data_position["index"] + 1}
    step_start = time.perf_counter()

    # Rollout: group_size replies to each of this rank's prompts, sampled from the current policy (temperature 1, no
    # top-k) with the seed a function of (seed, rank, step), so that a resume samples the very same replies.
    mine = [int(i) for i in step_prompts[rank::world_size] for _ in range(args.group_size)]  # a group stays on its rank
    prompts = [train_prompts[i] for i in mine]
    model.eval()
    model.set_reshard_after_forward(False)  # each layer is gathered at the first token and kept: not once per token
    torch.manual_seed(int(np.random.SeedSequence([args.seed, rank, step]).generate_state(1)[0]))
    with torch.no_grad():  # synced: all ranks step until all are done, as the gathers at the first token are collective
        max_new_tokens = bucket_len - max(map(len, prompts)) if prompts else 1  # none: keep the others' steps short
        replies = modeling.generate_replies(model, prompts, max_new_tokens, temperature=1.0, top_k=0, synced=True)
    model.set_reshard_after_forward(args.reshard_after_forward)
    for module in [*model.model.layers, model]:
        module.reshard()  # back to shards for training: the gathered copies are freed
    model.train()
    # Reward 1 for the reference answer, as --reward reads replies, else 0 (none, or cut short: 0).
    answers = [grading.reply_answer(tokenizer, reply, args.reward) for reply in replies]  # None: no answer
    rewards = torch.tensor([float(answer == train_answers[i]) for i, answer in zip(mine, answers)])
    # GRPO's advantage (Shao et al., 2024): a reply's reward less the mean reward of its group, the replies to one
    # prompt. Not divided by the group's std (Dr. GRPO, Liu et al., 2025): a group of equal rewards weighs exactly 0,
    # and one of nearly equal rewards is not blown up.
    groups = rewards.view(-1, args.group_size)
    advantages = (groups - groups.mean(dim=1, keepdim=True)).flatten()
    rollouts = rollout_split(prompts, replies)
    flat = (groups.max(1).values == groups.min(1).values).sum()  # groups whose rewards are all equal
    with_markers = sum(grading.solution_text(tokenizer, reply) is not None for reply in replies)
    worked = sum(grading.is_worked(tokenizer, reply) for reply in replies)  # replies whose thought holds anything
    stats = torch.tensor([rewards.sum(), len(rewards), flat, len(groups), with_markers, worked,
                          rollouts.target_counts.sum(), rollouts.lengths.sum()], dtype=torch.float64, device=device)
    dist.all_reduce(stats)  # the step's totals over all ranks: rewards, groups, reply tokens (the loss's denominator)
    reward_sum, n_replies, flat_groups, n_groups, with_markers, worked, target_tokens, tokens = stats.tolist()
    target_tokens, tokens = int(target_tokens), int(tokens)
    rollout_time, train_start = time.perf_counter() - step_start, time.perf_counter()

    batches = []
    for micro in range(micro_batches):
        sample_ids = range(micro * batch_size, min((micro + 1) * batch_size, len(replies)))  # none: padding rows only
        input_ids, targets = data.collate(rollouts, sample_ids, bucket_len, batch_size, device)
        row_advantages = torch.zeros(batch_size)
        row_advantages[:len(sample_ids)] = advantages[sample_ids.start:sample_ids.stop]
        batches.append((input_ids, targets, row_advantages[:, None].expand_as(targets)))
    loss_sum, grad_norm = train_step(batches, target_tokens)
    step_sums = torch.stack([loss_sum, loss_sum.new_full((), len(stop_signals))])  # any rank's signal stops all ranks
    dist.all_reduce(step_sums)  # for the log and the check (the gradients were already exact), and the stop
    loss_sum, stop_votes, grad_norm = torch.cat([step_sums, grad_norm[None]]).tolist()  # the update's one wait for it
    loss = loss_sum / target_tokens
    metrics.stop_if_nonfinite(step + 1, loss, grad_norm)  # global values: all ranks stop alike, before updating
    lr = common.learning_rate(step, args)  # from the step and this run's flags: a resumed run follows a new --lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step += 1

    step_time = time.perf_counter() - train_start
    step_peak_mem_gb, step_peak_reserved_gb = metrics.step_peak_memory_gb(device)
    run_peak_mem_gb = max(run_peak_mem_gb, step_peak_mem_gb)
    padded_tokens = world_size * micro_batches * batch_size * bucket_len
    total_tokens, total_padded = total_tokens + tokens, total_padded + padded_tokens
    flops = modeling.flops_per_token(n_params, model_config, bucket_len) * tokens
    mfu = flops / step_time / (peak_flops * world_size) if peak_flops else None  # None where the peak is unknown (CPUs)
    if step % args.log_every == 0 or step == args.max_steps:
        log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
             "padded_tokens": padded_tokens, "target_tokens": target_tokens, "bucket_len": bucket_len,
             "batch_size": batch_size, "tokens_per_s": tokens / step_time,
             "mfu": mfu, "peak_mem_gb": step_peak_mem_gb, "peak_reserved_gb": step_peak_reserved_gb,
             "elapsed_s": time.perf_counter() - start_time, "reward": reward_sum / n_replies,
             "zero_spread_groups": flat_groups / n_groups, "reply_tokens": target_tokens / n_replies,
             "with_markers": with_markers / n_replies, "worked": worked / n_replies, "rollout_s": rollout_time,
             "train_s": step_time})
    eval_owed = stop_votes > 0 and step % args.eval_every == 0 and step < args.max_steps  # saved, made up on resume
    if step == args.max_steps or (step % args.eval_every == 0 and not eval_owed):  # a stopped step saves at once
        validation = evaluate()
        log({"step": step, **validation})
    if step % args.save_every == 0 or step == args.max_steps or stop_votes:
        with checkpoints.report_failure(args.out_dir, step):  # a refused write (a full disk): one line, no traceback
            save_checkpoint(step, data_position)
    if rank == 0:  # the bar redraws at most every 0.1 s (tqdm's mininterval), not at every step
        progress.set_postfix({"loss": f"{loss:.3f}", "reward": f"{reward_sum / n_replies:.2f}",
                              **({"mfu": f"{mfu:.1%}"} if mfu else {}), "mem": f"{step_peak_mem_gb:.2f}GB",
                              "accuracy": validation.get("val_accuracy")}, refresh=False)
        progress.update(1)

# ---------------------------------------------------------------------------------------------- end
if rank == 0:
    progress.close()
    writer.close()
    metrics_file.close()
    elapsed = time.perf_counter() - start_time
    print(f"done: {step} steps, val loss {validation.get('val_loss', float('nan')):.4f}, "
          f"answer accuracy {validation['val_accuracy']}, non-padding share {total_tokens / max(1, total_padded):.1%}, "
          f"{total_tokens / elapsed:,.0f} tokens/s, {elapsed:.0f}s; metrics and checkpoints in {args.out_dir}")
param_elements, optimizer_elements = modeling.local_state_sizes(model, optimizer)
print(f"rank {rank} holds {param_elements:,} parameter and {optimizer_elements:,} optimizer-state elements "
      f"({n_params:,} parameters in the model), peak memory in training {run_peak_mem_gb:.2f} GB")
dist.barrier()  # without it, a rank that exits first can abort the others' gloo teardown
dist.destroy_process_group()
time.sleep(0.2)  # let gloo's threads free the last collectives' tensors: in Python's exit that aborts (pytorch#190489)
if stop_votes and step < args.max_steps:  # a signal stopped the run, its step saved: a status of its own says so
    common.exit_stopped(step, checkpoint_root)
