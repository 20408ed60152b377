"""What a user would run instead of our scripts, on the same model, data and machine (launched by bench.py):

    torchrun --nproc_per_node=2 benchmarks/baselines.py bare    --model small --steps 40   # our batches, bare loop
    torchrun --nproc_per_node=1 benchmarks/baselines.py bare --strategy fsdp2 --compile-more loss,embedding,optimizer
    torchrun --nproc_per_node=2 benchmarks/baselines.py trainer --model small --steps 40   # HF Trainer, run_clm style
    torchrun --nproc_per_node=2 benchmarks/baselines.py trl --data data/conversations ... # TRL SFTTrainer

Each prints one line `result {json}` on rank 0: non-padding tokens and seconds over the steps after --skip. The bare
loop then trains --tail steps more (untimed: benchmarks/step_profile.py records some), and with --compile-more one
phase per part named, each compiling that part too, for --phase-steps steps (the last two thirds timed): a line
`phase {json}` each. They ask what compiling more of the step would gain before a script does it.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from baseline_rows import trainer_blocks, trl_rows  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import loading  # noqa: E402
import metrics  # noqa: E402
import modeling  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["bare", "trainer", "trl"])
parser.add_argument("--model", default="small")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the timing")
parser.add_argument("--data", default=None, help="a prepared folder (default: data/builtin; trl: data/builtin-sft)")
parser.add_argument("--buckets", default=None)
parser.add_argument("--tokens-per-batch", type=int, default=None)
parser.add_argument("--out-dir", default="/tmp/baselines")
parser.add_argument("--compile", action="store_true", help="bare loop: compile the decoder layers as our scripts do")
parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp", help="bare loop: wrapped as ddp_pretrain.py "
                    "wraps (autocast), or as fsdp2_pretrain.py (fully_shard per layer, bf16 parameters on CUDA)")
parser.add_argument("--activation-checkpointing", choices=["full", "selective", "none"], default="full")
parser.add_argument("--tail", type=int, default=0, help="bare loop: untimed steps after the timed ones")
parser.add_argument("--compile-more", default="", help="bare loop: comma-separated parts (loss, embedding, optimizer), "
                    "each compiled in a phase of its own after the others, cumulatively")
parser.add_argument("--phase-steps", type=int, default=15)
parser.add_argument("--compile-backend", default="inductor", help="--compile-more's torch.compile backend (the GPU "
                    "check's dry run: eager, which traces without generating code)")
cli = parser.parse_args()
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
presets = loading.script_presets("fsdp2_sft.py" if cli.mode == "trl" else "ddp_pretrain.py")  # their training defaults
args = common.finalize_args(common.parse_args(common.get_parser("", cli.out_dir), presets,
    ["--model", cli.model, "--out-dir", cli.out_dir]
    + (["--buckets", cli.buckets] if cli.buckets else [])
    + (["--tokens-per-batch", str(cli.tokens_per_batch)] if cli.tokens_per_batch else [])), None)
args.data = cli.data or ("data/builtin-sft" if cli.mode == "trl" else "data/builtin")


def report(tokens, padded_tokens, seconds, **extra):
    """One line from rank 0; the (non-padding and padded) tokens are this rank's, summed over ranks here."""
    # NCCL reduces only tensors on the GPU.
    totals = torch.tensor([float(tokens), float(padded_tokens)],
                          device="cuda" if torch.cuda.is_available() else "cpu")
    if dist.is_initialized():
        dist.all_reduce(totals)
    tokens, padded_tokens = map(int, totals.tolist())
    if rank == 0:
        print("result " + json.dumps({"mode": cli.mode, "tokens": tokens, "seconds": seconds,
                                      "tokens_per_s": tokens / seconds, "non_padding": tokens / padded_tokens,
                                      **extra}), flush=True)


def hf_model():
    """The preset's model, called as Trainer and TRL call it (labels=, no targets=): transformers' own forward and loss
    (full logits)."""
    torch.manual_seed(args.seed)
    return modeling.build_model(args.model)


if cli.mode == "bare":
    # Our DDP batches, and nothing but forward, backward and the optimizer step: the floor our loop is measured
    # against. The same device, precision and compilation as ddp_pretrain.py (or fsdp2_pretrain.py).
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    train, _ = data.load_pretraining_data(argparse.Namespace(**{**vars(args), "data": [args.data]}))
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
              else torch.device("cpu"))
    common.init_process_group(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    model = modeling.build_model(args.model, cli.activation_checkpointing).to(device)
    if cli.compile:  # as the scripts compile: each layer, static shapes, one graph per bucket for training
        torch._dynamo.config.recompile_limit = 2 * len(args.buckets) + 6  # and --compile-more's loss: a few shapes
        for layer in model.model.layers:
            layer.compile(dynamic=False)
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    if cli.strategy == "fsdp2":
        mixed_precision = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mixed_precision)
        fully_shard(model, mp_policy=mixed_precision)
    else:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = torch.autocast(device.type, dtype=bf16, enabled=cli.strategy == "ddp" and bf16 != torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=True)
    optimizer_step = optimizer.step
    schedule = data.epoch_schedule(train.lengths, args.buckets, args.tokens_per_batch, world_size, 1, args.seed, 0)
    if len(schedule) < cli.steps:  # ours would go on into epoch 1: the step times would no longer pair up
        sys.exit(f"--steps {cli.steps} is more than the {len(schedule)} steps of one epoch")

    done = [0]  # steps trained so far

    def run_steps(steps, skip):
        """STEPS steps of the schedule's (on from where the last call left it, round the epoch), the ones after the
        first SKIP timed: (non-padding tokens, padded tokens, the end of each timed step and of step SKIP)."""
        tokens, padded_tokens, step_ends = 0, 0, []
        for step in range(1, steps + 1):
            bucket_len, step_samples = schedule[done[0] % len(schedule)]
            done[0] += 1
            if step == skip + 1:
                dist.barrier()
                metrics.step_peak_memory_gb(device)  # a new peak: the measured steps', as the scripts log a step's
                step_ends.append(time.perf_counter())
            batch_size = data.bucket_batch_size(args.tokens_per_batch, bucket_len)
            input_ids, targets = data.collate(train, step_samples[rank::world_size], bucket_len, batch_size, device)
            target_tokens = int(train.target_counts[step_samples].sum())
            with autocast:
                loss_sum = model(input_ids=input_ids, targets=targets)
            (loss_sum * world_size / target_tokens).backward()
            optimizer_step()
            optimizer.zero_grad(set_to_none=True)
            if step > skip:
                tokens, padded_tokens = (tokens + int(train.lengths[step_samples[rank::world_size]].sum()),
                                         padded_tokens + batch_size * bucket_len)
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the step's kernels are done (ours waits for the loss every step too)
                step_ends.append(time.perf_counter())
        dist.barrier()
        return tokens, padded_tokens, step_ends

    tokens, padded_tokens, step_ends = run_steps(cli.steps, cli.skip)
    peak_allocated_gb, peak_reserved_gb = metrics.step_peak_memory_gb(device)
    report(tokens, padded_tokens, step_ends[-1] - step_ends[0],
           step_seconds=[b - a for a, b in zip(step_ends, step_ends[1:])],  # per step, as ours
           peak_allocated_gb=peak_allocated_gb, peak_reserved_gb=peak_reserved_gb)
    run_steps(cli.tail, cli.tail)
    for part in filter(None, cli.compile_more.split(",")):
        # Each part compiled as a script would compile it: the loss's passes over the vocabulary (the chunk's function,
        # its row count dynamic), the embedding in place, the optimizer step (foreach AdamW traced, as torch's compiled
        # optimizer recipe does: the fused kernel is already one).
        if part == "loss":
            modeling.logit_losses = torch.compile(modeling.logit_losses, backend=cli.compile_backend)
        elif part == "embedding":
            model.model.embed_tokens.compile(backend=cli.compile_backend)
        elif part == "optimizer":
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), foreach=True)
            optimizer_step = torch.compile(optimizer.step, backend=cli.compile_backend)
        else:
            sys.exit(f"--compile-more: unknown part {part}: loss, embedding or optimizer")
        tokens, padded_tokens, step_ends = run_steps(cli.phase_steps, cli.phase_steps // 3)  # the rest timed
        peak_allocated_gb, peak_reserved_gb = metrics.step_peak_memory_gb(device)
        if rank == 0:
            print("phase " + json.dumps({"compiled": part, "tokens_per_s": tokens / (step_ends[-1] - step_ends[0]),
                                         "step_seconds": [b - a for a, b in zip(step_ends, step_ends[1:])],
                                         "peak_allocated_gb": peak_allocated_gb, "peak_reserved_gb": peak_reserved_gb}),
                  flush=True)

else:
    import datasets
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Time and non-padding tokens between the end of step --skip and the end of the last step."""

        def __init__(self):
            self.tokens, self.padded, self.start, self.start_tokens, self.start_padded = 0, 0, None, 0, 0

        def on_step_end(self, training_args, state, control, **kwargs):
            if state.global_step == cli.skip:
                self.start, self.start_tokens, self.start_padded = time.perf_counter(), self.tokens, self.padded
            if state.global_step == cli.steps:
                self.seconds, self.window_tokens = time.perf_counter() - self.start, self.tokens - self.start_tokens
                self.window_padded = self.padded - self.start_padded

    clock = StepClock()
    common_args = dict(output_dir=cli.out_dir, max_steps=cli.steps, learning_rate=args.lr,
                       warmup_steps=args.warmup_steps, lr_scheduler_type="cosine", weight_decay=args.weight_decay,
                       adam_beta2=0.95, max_grad_norm=args.grad_clip,
                       activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False},
                       use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
                       ddp_backend=None if torch.cuda.is_available() else "gloo",
                       logging_steps=10**6, save_strategy="no", eval_strategy="no", report_to=[],
                       dataloader_num_workers=0, seed=args.seed, disable_tqdm=True)

    if cli.mode == "trainer":
        # transformers' run_clm.py pipeline: tokenize, concatenate everything, cut into blocks of one length.
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        block = args.buckets[-1]
        corpus = data.open_prepared(args.data, "--data")
        blocks = datasets.Dataset.from_dict({"input_ids": trainer_blocks(corpus, block)})

        def collate(examples):  # the language-modeling collator: labels are the inputs (the model shifts them)
            block_tokens = sum(len(example["input_ids"]) for example in examples)
            # Blocks of one length: no padding.
            clock.tokens, clock.padded = clock.tokens + block_tokens, clock.padded + block_tokens
            return {"input_ids": torch.tensor([example["input_ids"] for example in examples]),
                    "labels": torch.tensor([example["input_ids"] for example in examples])}

        batch_size = data.bucket_batch_size(args.tokens_per_batch, block)
        trainer = Trainer(model=hf_model(), train_dataset=blocks, data_collator=collate, callbacks=[clock],
                          args=TrainingArguments(per_device_train_batch_size=batch_size, **common_args))
        trainer.train()
        report(clock.window_tokens, clock.window_padded, clock.seconds, batch_size=batch_size, block=block)

    else:
        # TRL's SFTTrainer on our very conversations (token ids and assistant-only labels), one fixed batch size:
        # as many of the longest samples as fit the token budget of our largest bucket.
        from trl import SFTConfig, SFTTrainer
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        train, _ = data.load_sft_data(args)
        rows = trl_rows(train)  # our token ids, labels on the assistant's tokens
        batch_size = max(1, args.tokens_per_batch // int(max(train.lengths)))  # an int: DataLoader refuses numpy's
        pad = DataCollatorForLanguageModeling(pad_token_id=common.EOT_ID)

        def collate(examples):  # TRL's own collator (pads to the longest in the batch), counting real tokens
            clock.tokens += sum(len(example["input_ids"]) for example in examples)
            clock.padded += len(examples) * max(len(example["input_ids"]) for example in examples)
            return pad(examples)

        from export_hf import hf_tokenizer

        trainer = SFTTrainer(model=hf_model(), train_dataset=datasets.Dataset.from_dict(rows), data_collator=collate,
                             callbacks=[clock], processing_class=hf_tokenizer(),
                             args=SFTConfig(per_device_train_batch_size=batch_size, max_length=args.buckets[-1],
                                            **common_args))
        trainer.train()
        report(clock.window_tokens, clock.window_padded, clock.seconds, batch_size=batch_size,
               longest=int(max(train.lengths)))

# Leave as our scripts do (Trainer and TRL set the group up and leave it): without a barrier before the teardown,
# gloo aborts about 2 exits in 5 ("terminate called without an active exception").
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.2)  # as the scripts do: gloo's threads free the last collectives' tensors before Python exits
