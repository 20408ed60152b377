"""Finetune low-rank adapters (LoRA) of the frozen pretrained model with FSDP2 on reasoning conversations: marker
tokens, their rows trained beside the adapters, loss on assistant tokens only.

    torchrun --standalone --nproc_per_node=2 fsdp2_lora_sft.py                # after fsdp2_pretrain.py; builtin set
    torchrun --standalone --nproc_per_node=8 fsdp2_lora_sft.py --model qwen2-0.5b --data data/openthoughts

--data: a folder of prepare_data.py (`python prepare_data.py` writes data/builtin-sft; its docstring says how to write
data/openthoughts). The base is runs/fsdp2_pretrain's newest checkpoint unless --init-from names another; each
checkpoint holds the adapters and names its base. `python export_hf.py RUN OUT` writes the base and a PEFT folder.
LoRA's best learning rate was 1x (small, midtrained base) to 3.3x (tiny) the full SFT's; the presets' follow it.
"""
import hashlib
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
from torch.distributed.tensor import distribute_tensor
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
# What --init-from reads, the base: a model/ folder of DCP shards (the FSDP2 layout) or an export_hf.py folder.
STARTS_FROM = ["fsdp2_pretrain", "fsdp2_tp_pretrain", "fsdp2_cp_pretrain", "pp_pretrain", "fsdp2_sft", "fsdp2_grpo",
               "fsdp2_3d_pretrain", "fsdp2_muon_pretrain", "export_hf"]
# The projections that get an adapter unless --lora-targets names others: attention's and the MLP's.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Each --model preset's training defaults: the values of the flags left unset (its shape: common.MODEL_PRESETS).
PRESETS = {
    "tiny": dict(buckets=[64, 96, 128], tokens_per_batch=512, lr=1e-2, warmup_steps=5, max_steps=20, eval_every=10,
                 save_every=10, eval_generate=16),
    # 11 points on the curves (steps 0, 150, ..., 1500), each answering 50 held-out problems (evaluate.py: 200).
    "small": dict(buckets=[68, 96], tokens_per_batch=512, lr=3e-3, warmup_steps=30, max_steps=1500, eval_every=150,
                  save_every=500, eval_generate=50),
    "qwen2-0.5b": dict(buckets=[512, 1024, 2048, 4096, 8192], tokens_per_batch=16384, lr=1e-4, warmup_steps=50,
                       max_steps=2000, eval_every=250, save_every=500, eval_generate=200),
}

# ---------------------------------------------------------------------------------------------- setup
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
parser = common.get_parser(__doc__, f"runs/{SCRIPT}")
common.add_batch_arguments(parser)  # --grad-accum, --bucket-order
parser.add_argument("--data", default="data/builtin-sft", help="a folder of conversations (prepare_data.py --sft)")
parser.add_argument("--init-from", default="runs/fsdp2_pretrain", help="the checkpoint to start from: a checkpoint "
                    "folder, a run folder (its newest) or an export_hf.py folder")
parser.add_argument("--reshard-after-forward", type=common.boolean, default=True, help="true: a layer's gathered "
                    "parameters are freed after forward, gathered again in backward (ZeRO-3); false: kept (ZeRO-2)")
parser.add_argument("--eval-generate", type=common.NON_NEGATIVE_INT, default=None,
                    help="held-out problems answered by greedy generation at each evaluation (answer accuracy)")
parser.add_argument("--lora-rank", type=common.COUNT, default=16, help="r: each adapter's update is B A, "
                    "B out x r (zeros at the start), A r x in (random)")
parser.add_argument("--lora-alpha", type=common.number(float, 1e-9), default=32.0, help="the update is scaled by "
                    "alpha / r, so a new --lora-rank keeps its size at the start of training")
parser.add_argument("--lora-targets", type=lambda text: text.split(","), default=TARGETS,
                    help=f"comma-separated projections that get an adapter (default: {','.join(TARGETS)})")
embedding_flags = parser.add_mutually_exclusive_group()  # which token rows train beside the adapters: some, or all
embedding_flags.add_argument("--trainable-tokens", default=list(common.SPECIAL_TOKENS.values()), type=lambda text: [
    *dict.fromkeys(common.number(int, 0, common.VOCAB_SIZE - 1)(token) for token in text.split(","))], help="comma-"
    "separated token ids whose rows train, in the embedding and the tied head (PEFT's trainable_token_indices; "
    "default: the markers)")
embedding_flags.add_argument("--train-embedding", action="store_true", help="train the whole embedding (PEFT's "
                             "modules_to_save): for an undertrained one, as the CPU presets' (docs/sft.md)")
parser.add_argument("--base-dtype", choices=["fp32", "nf4"], default="fp32", help="how the targets' frozen weights are "
                    "stored: as the other parameters, or in 4 bits (torchao's NF4, as QLoRA), dequantized to compute")
parser.add_argument("--replay", default=None, help="SOURCE:SHARE: pretraining text trained on beside the conversations "
                    "as that share of the tokens, every token a target, so that the model keeps its prose (e.g. "
                    "data/builtin:0.2; default: none)")
parser.set_defaults(weight_decay=0.0)  # PEFT's default: the adapters do not decay unless --weight-decay says so
args = common.parse_args(parser, PRESETS)  # the flags left unset: the --model preset's
tokens_per_step = args.tokens_per_batch * args.grad_accum * world_size  # positions a step computes, padding too
args = common.finalize_args(args, tokens_per_step)
if unknown := sorted(set(args.lora_targets) - set(TARGETS)):
    raise common.UsageError(f"--lora-targets: {','.join(unknown)} is not a projection of the model: pick from "
                            f"{','.join(TARGETS)}")
shape = common.MODEL_PRESETS[args.model]["model"]  # k's and v's width: kv heads x head width; the others' the hidden
kv_width = shape["hidden_size"] * shape["num_key_value_heads"] // shape["num_attention_heads"]
narrowest = min(kv_width if name in ("k_proj", "v_proj") else shape["hidden_size"] for name in args.lora_targets)
if args.lora_rank > narrowest:
    raise common.UsageError(f"--lora-rank {args.lora_rank} is above the narrowest target's width ({narrowest}, "
                            f"--model {args.model}): pass at most {narrowest}")
widths = [shape["hidden_size"], shape["intermediate_size"], kv_width]  # the projections' rows; the first two: columns
misfits = [w for w in widths[:2] if w % 64] + [w for w in widths if w % world_size]  # NF4: whole blocks, whole rows
if args.base_dtype == "nf4" and (world_size < 2 or misfits):
    raise common.UsageError(f"--base-dtype nf4 needs 2 ranks or more (pytorch#197999), and widths {widths} (--model "
                            f"{args.model}) in whole blocks of 64 and whole rows a rank: pass --base-dtype fp32")
run_folder_lock = common.lock_folder(args.out_dir, "--out-dir") if rank == 0 else None  # one writer, until exit
stop_signals = common.note_stop_signals()  # SIGTERM, SIGINT, SIGUSR1: this rank's, until the step's end
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
fake = args.estimate_memory == "fake"  # estimate_memory.py's: fake tensors on a fake process group, shapes only
checkpoint_root = Path(args.out_dir) / "checkpoints"
resume_dir = checkpoints.find_resume_checkpoint(args, checkpoint_root, SCRIPT)
trained_on = checkpoints.read_meta(resume_dir, "--resume")["config"] if resume_dir else {}  # the adapters' base
if trained_on and checkpoints.newest_checkpoint(trained_on["init_from"]):  # read where it lay while it lies there
    args.init_from = trained_on["init_from"]
init_dir = None if args.estimate_memory else checkpoints.find_init_checkpoint(args, STARTS_FROM)  # on resume too
args.base_sha256 = init_dir and hashlib.sha256((init_dir / "meta.json").read_bytes()).hexdigest()  # where it lies
if trained_on.get("base_sha256", args.base_sha256) != args.base_sha256:  # (its meta.json: its step, flags, sizes)
    raise common.UsageError(f"--init-from {init_dir}: the adapters of --resume {resume_dir} were trained on "
                            f"{trained_on['init_from']}, moved or gone: pass --init-from where that base lies now")
args.init_from = str(init_dir or args.init_from)  # recorded in each checkpoint: the base's folder, as found

# ---------------------------------------------------------------------------------------------- data
tokenizer = common.get_chat_tokenizer()  # GPT-2 BPE plus the role and reasoning markers
# Splits over the memory-mapped tokens; the targets: assistant tokens only.
train, val = data.load_sft_data(args)
if args.replay:  # pretraining text mixed in as that share of the tokens, every token a target, its own validation split
    source, share = data.source_and_weight(args.replay, "--replay")
    text = data.open_prepared(source, "--replay")
    if text.chat_format or share is None or share >= 1:
        raise common.UsageError(f"--replay {args.replay}: pass a folder of pretraining text and its share of the "
                                f"tokens, below 1, e.g. data/builtin:0.2")
    replayed, val[f"replay-{data.source_names([source])[0]}"] = data.text_splits(text, args)
    train = data.mixture([train, replayed], np.array([1 - share, share]))
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
class LoRALinear(torch.nn.Module):
    """A frozen Linear and its adapter: y = W x + b + (alpha / r) B A x. The names are PEFT's (base_layer, lora_A,
    lora_B), so an export only prefixes them."""

    def __init__(self, base_layer, rank, alpha):
        super().__init__()
        self.base_layer, self.scale = base_layer, alpha / rank
        self.lora_A = torch.nn.Linear(base_layer.in_features, rank, bias=False, device=base_layer.weight.device)
        self.lora_B = torch.nn.Linear(rank, base_layer.out_features, bias=False, device=base_layer.weight.device)
        torch.nn.init.zeros_(self.lora_B.weight)  # B = 0: training starts from the base's outputs exactly

    def forward(self, x):
        return self.base_layer(x) + self.scale * self.lora_B(self.lora_A(x))  # A x first: r-wide, never out x in


class TrainableTokens(torch.nn.Module):
    """A frozen embedding, or its tied head, whose rows token_indices add trainable_tokens_delta (zeros at the start):
    PEFT's trainable tokens and names, the two sharing one delta, so the head follows the tie."""

    def __init__(self, base_layer, token_indices, delta):
        super().__init__()
        self.base_layer, self.token_indices, self.trainable_tokens_delta = base_layer, token_indices, delta

    @property
    def weight(self):  # what the chunked loss reads of the head
        return self.base_layer.weight.index_add(0, self.token_indices, self.trainable_tokens_delta)

    def forward(self, x):  # token ids, or (the head) hidden states
        return torch.nn.functional.linear(x, self.weight) if x.is_floating_point() else self.weight[x]


torch.manual_seed(args.seed)  # the same init on every rank, and in every script
model = modeling.build_model(args.model, args.activation_checkpointing, args.loss_chunk_rows, fake)
model.requires_grad_(False)  # the base is frozen: only the adapters added next have gradients and AdamW moments
for layer in model.model.layers:  # A is drawn in this fixed order, the same on every rank (nn.Linear's own init)
    for block in (layer.self_attn, layer.mlp):
        for name in [name for name in TARGETS if name in args.lora_targets and hasattr(block, name)]:
            setattr(block, name, LoRALinear(getattr(block, name), args.lora_rank, args.lora_alpha))
n_params, model_config = model.num_parameters(), model.config  # transformers' count: a tied weight once
if rank == 0:
    common.write_config(args, SCRIPT, world_size, device, dtype, n_params, tokens_per_step, resume_dir or init_dir)
# The base's weights, on resume too (a checkpoint holds only the adapters), each under the base's own name: read whole
# on every rank before the wrap (which shards them), because NF4 quantizes whole rows.
base_names = {name: name.replace(".base_layer.", ".") for name in get_model_state_dict(model) if "lora_" not in name}
if init_dir is not None and checkpoints.is_hf_folder(init_dir):  # export_hf.py's
    whole = checkpoints.hf_state_dict(init_dir)
    set_model_state_dict(model, {name: whole[base_name] for name, base_name in base_names.items()},
                         options=StateDictOptions(strict=False))
elif init_dir is not None:
    model_state = get_model_state_dict(model)  # whole tensors: DCP reads every shard of each
    dcp.load({base_name: model_state[name] for name, base_name in base_names.items()}, checkpoint_id=init_dir / "model")
    set_model_state_dict(model, model_state)
if args.base_dtype == "nf4":  # 64 weights a block, its scale; the scales quantized a row at a time, so a rank's rows
    from torchao.quantization import to_nf4  # quantize alike in any world (torchao: read only for this flag)
    for linear in [module.base_layer for module in model.modules() if isinstance(module, LoRALinear)]:
        linear.weight = torch.nn.Parameter(to_nf4(linear.weight.detach(), 64, linear.in_features // 64), False)
if args.train_embedding:  # PEFT's modules_to_save: the whole embedding trains, and the head tied to it
    model.model.embed_tokens.weight.requires_grad_(True)
else:  # PEFT's trainable_token_indices: these rows alone train, one delta for the embedding and the tied head
    delta, token_rows = torch.nn.Parameter(torch.zeros(len(args.trainable_tokens), model_config.hidden_size)), \
        torch.tensor(args.trainable_tokens, device=device)
    model.model.embed_tokens, model.lm_head = (TrainableTokens(module, token_rows, delta)
                                               for module in (model.model.embed_tokens, model.lm_head))
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

# ---------------------------------------------------------------------------------------------- init from a checkpoint
marker_rows = None  # the base's own, unless set here: then saved in each checkpoint, as the base's part of the run
if init_dir is not None and not checkpoints.read_meta(init_dir, "--init-from").get("chat_format"):
    # The marker rows (50,257 and up) were never trained: start them at the mean of the real token rows, so
    # their logits start at an average token's, plus tiny noise so that they differ from each other.
    with torch.no_grad():
        embedding = getattr(model.lm_head, "base_layer", model.lm_head).weight  # the base's; a DTensor sharded by rows
        rows = embedding.full_tensor()  # this one matrix is gathered, once
        new_rows = slice(common.EOT_ID + 1, common.EOT_ID + 1 + len(common.SPECIAL_TOKENS))
        rows[new_rows] = rows[:common.EOT_ID + 1].mean(0) + 1e-3 * torch.randn_like(rows[new_rows])
        embedding.copy_(distribute_tensor(rows, embedding.device_mesh, embedding.placements))
        marker_rows = rows[new_rows].clone()

# ---------------------------------------------------------------------------------------------- optimizer
# Matrices decay; biases and norm gains do not: decided by name, the same rule in every script. Only what trains.
trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
frozen_grad_flops = 2 * sum(p.numel() for n, p in model.named_parameters() if n not in trainable and "embed" not in n)
decay = [p for name, p in trainable.items() if not (name.endswith("bias") or "norm" in name)]
no_decay = [p for name, p in trainable.items() if name.endswith("bias") or "norm" in name]
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
        model.set_requires_gradient_sync(micro == len(batches) - 1)  # FSDP2's switch for no_sync()
        # The summed loss; logits only at target positions, a chunk at a time (modeling.Qwen2WithChunkedLoss).
        micro_loss_sum = model(input_ids=input_ids, targets=targets)
        (micro_loss_sum * world_size / target_tokens).backward()
        loss_sum += micro_loss_sum.detach()
    # Every gradient's norm in one foreach kernel, in fp64: on a CPU fp32 drifts ~1e-4 on big tensors (pytorch#169237).
    norms = torch._foreach_norm([p.grad for p in trainable.values()], 2, torch.float64)  # DTensors: each shard's
    grad_norm = torch.stack(norms).square().sum().sqrt().float().full_tensor()  # one all-reduce adds the shards'
    torch.nn.utils.clip_grads_with_norm_(trainable.values(), args.grad_clip or float("inf"), grad_norm)
    return loss_sum, grad_norm


if args.estimate_memory:  # estimate_memory.py: this step, measured per bucket on full batches; the process ends there
    metrics.estimate_memory(args, model, optimizer, train_step, device, lambda rows: args.grad_accum)


# ---------------------------------------------------------------------------------------------- checkpoint
def adapter_state():
    """What trains, of the model's state dict (PEFT's names after base_model.model.; a tied head's copy left out)."""
    return {name: tensor for name, tensor in get_model_state_dict(model).items() if name in trainable}


def save_checkpoint(step, data_position):
    """Every rank writes its own shards with DCP into a partial folder that is renamed once complete."""
    partial_dir = checkpoint_root / f".partial_step_{step}"
    if rank == 0:
        shutil.rmtree(partial_dir, ignore_errors=True)
        partial_dir.mkdir(parents=True)
        torch.save({"step": step, "data_position": data_position, "rng": torch.get_rng_state(),
                    "marker_rows": marker_rows, "eval_owed": eval_owed},
                   partial_dir / "train_state.pt")  # one copy: ranks seed alike
    dist.barrier()  # the folder exists before anyone writes into it
    dcp.save(adapter_state(), checkpoint_id=partial_dir / "model")  # what trains, as DTensor shards: no frozen weight
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=partial_dir / "optimizer")  # keyed by name too
    if rank == 0:
        checkpoints.commit_checkpoint(partial_dir, args, SCRIPT, step, world_size, data_order, RESUMED_BY,
                                      train.chat_format)
    dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is committed


def load_checkpoint(checkpoint_dir):
    """DCP loads in place into state dicts shaped for THIS world size (so it reshards), then we set them."""
    # get_optimizer_state_dict first gives a fresh AdamW its moments: dcp.load(optimizer.state_dict()) would load none.
    model_state, optimizer_state = adapter_state(), get_optimizer_state_dict(model, optimizer)
    dcp.load(model_state, checkpoint_id=checkpoint_dir / "model")
    dcp.load(optimizer_state, checkpoint_id=checkpoint_dir / "optimizer")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(strict=False))  # the base's weights are already in place
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
# Answer accuracy: greedy replies to held-out prompts (the first validation split's: the conversations'), compared
# with the reference between the solution markers.
val_prompts, val_answers, max_reply_tokens = grading.answer_prompts(tokenizer, next(iter(val.values())),
                                                                 args.eval_generate, "exact-text")


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
    answers = [grading.solution_text(tokenizer, reply) for reply in replies]  # the text between the solution markers
    correct = sum(answer == val_answers[i] for i, answer in zip(mine, answers))
    correct = torch.tensor(float(correct), device=device)
    dist.all_reduce(loss_sums)
    dist.all_reduce(correct)
    model.train()
    target_counts = [sum(split.target_counts) for split in val.values()]
    return {"val_loss": loss_sums.sum().item() / sum(target_counts),
            **{f"val_loss/{name}": loss / count for name, loss, count in zip(val, loss_sums.tolist(), target_counts)},
            "val_accuracy": correct.item() / len(val_prompts) if val_prompts else None}


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
    flops = (modeling.flops_per_token(n_params, model_config, bucket_len) - frozen_grad_flops) * tokens
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
