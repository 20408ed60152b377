r"""GRPO throughput, ours against TRL's: fsdp2_grpo.py and TRL's GRPOTrainer with the same model, the same prompts
in the same order, the same group size, reply-length bound and optimizer, one process each on this machine's CPU.

    .venv/bin/python benchmarks/grpo_trl.py                      # the newest runs/fsdp2_sft checkpoint, 10 steps each
    .venv/bin/python benchmarks/grpo_trl.py --init-from runs/fsdp2_sft/checkpoints/step_2000 --steps 20 \
        --group-size 8 --prompts-per-step 4 --max-reply-tokens 74

Ours runs as `python fsdp2_grpo.py` (world size 1); TRL runs in this process on the checkpoint as export_hf.py writes
it. Two figures each, over the steps after --skip (default 1: the first step of both pays one-off costs, first
allocations and first kernels, which a run of hundreds of steps never sees again):
- replies sampled per second in the rollout phase: sampling, decoding, rewards and advantages, the span ours logs as
  rollout_s and GRPOTrainer spends in _generate_and_score_completions;
- optimizer steps per second: wall time of whole steps, from the end of step --skip to the end of the last (ours: its
  metrics rows' elapsed_s; TRL: a callback's clock at on_step_end), rollout and training together.
Mean reward and mean reply length are over all steps. Prints a table; writes a JSON file (--out).

The same in both: the weights (export_hf.py's Llama carries the Qwen2 weights, plus o_proj biases of zero); the prompts
of ours' training split in ours' step order, token for token (checked); prompts x group size replies per optimizer
step, generated in one batch and trained in one micro-batch; replies sampled at temperature 1 with no top-k or top-p,
ending at their first <|end_of_turn|> or <|endoftext|>, at most the bucket less the step's longest prompt long (ours'
bound, given to TRL step by step); transformers' generate with a KV cache and left padding in both; the reward
(grading.reply_answer, final-number); advantages of reward minus the group mean, not divided by the std; no reference
model, no KL; one optimizer step per batch of rollouts (on-policy: TRL's ratio is 1, its clip never acts); the loss's
normalization (see loss_type below); activation checkpointing of every decoder layer; fp32; fused AdamW, betas
(0.9, 0.95), eps 1e-8, weight decay 0.1 on all but biases and norms, a constant learning rate, the gradient norm
clipped to 1.

What differs, by design of each tool:
- the sampled replies: each tool draws from its own random stream, so the reply lengths (and so the work) and rewards
  differ; the table shows the mean reply length of each;
- ours' model is sharded by FSDP2 (a mesh of one) under a gloo process group, with its hooks around every layer; TRL's
  is a plain module under accelerate; its Llama also trains the o_proj biases (zeros at the start; 128 per layer in
  the small preset), which ours does not have;
- training: ours pads every rollout to the bucket and computes the head only at reply positions, 128 rows at a time;
  TRL pads to the batch's longest prompt plus longest reply and computes log-probs and entropies at reply positions in
  tiles (its fused LM head).
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import torch  # noqa: E402

import checkpoints  # noqa: E402
import common  # noqa: E402
import data  # noqa: E402
import grading  # noqa: E402
import loading  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--init-from", default="runs/fsdp2_sft",
                    help="an fsdp2_sft.py checkpoint folder, or its run folder (the newest checkpoint)")
parser.add_argument("--steps", type=common.COUNT, default=10, help="optimizer steps of each tool")
parser.add_argument("--skip", type=common.COUNT, default=1,
                    help="warm-up steps left out of the speed figures (at least 1: the clock starts at its end)")
parser.add_argument("--group-size", type=common.number(int, 2), default=8, help="replies per prompt")
parser.add_argument("--prompts-per-step", type=common.COUNT, default=4, help="prompts per optimizer step")
parser.add_argument("--max-reply-tokens", type=common.COUNT, default=74,
                    help="reply-length bound: the bucket is the longest training prompt plus this (74: the small "
                    "preset's GRPO bucket of 96 less the longest built-in RL prompt, 22 tokens)")
parser.add_argument("--lr", type=common.NON_NEGATIVE, default=1e-4, help="learning rate, constant")
parser.add_argument("--seed", type=common.NON_NEGATIVE_INT, default=1337, help="data order and sampling")
parser.add_argument("--out", default=str(REPO / "benchmarks" / "results-grpo-trl.json"), help="JSON results")
parser.add_argument("--work-dir", default=None, help="where both runs and the exported model go; must not hold an "
                    "earlier run's (default: a new temporary folder)")
cli = parser.parse_args()
if cli.skip >= cli.steps:
    parser.error(f"--skip {cli.skip} leaves no step of --steps {cli.steps} to time")
work = Path(cli.work_dir or tempfile.mkdtemp(prefix="grpo-trl-")).resolve()
ours_dir, hf_dir, trl_dir = work / "fsdp2_grpo", work / "hf", work / "trl"
if any(path.exists() for path in (ours_dir, hf_dir, trl_dir)):
    parser.error(f"--work-dir {work} holds an earlier run (fsdp2_grpo/, hf/ or trl/): choose a new one")
# Both tools on the CPU: TRL gets use_cpu, ours a process that sees no GPU.
env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
checkpoint_dir = loading.resolve_checkpoint(Path(cli.init_from))
preset = checkpoints.read_meta(checkpoint_dir, "--init-from")["model"]
replies_per_step = cli.prompts_per_step * cli.group_size
chat_tokenizer = common.get_chat_tokenizer()
subprocess.run([sys.executable, "prepare_data.py"], cwd=REPO, check=True)  # data/builtin-rl: both tools' problems


def grpo_flags(bucket_len):
    """fsdp2_grpo.py's flags: one micro-batch holds the step's rollouts, no evaluation inside the run, a constant LR."""
    return ["--model", preset, "--init-from", checkpoint_dir, "--max-steps", cli.steps,
            "--prompts-per-step", cli.prompts_per_step, "--group-size", cli.group_size, "--buckets", bucket_len,
            "--tokens-per-batch", bucket_len * replies_per_step, "--eval-every", 10**6, "--eval-generate", 0,
            "--save-every", 10**6, "--lr", cli.lr, "--min-lr-ratio", 1, "--warmup-steps", 0, "--seed", cli.seed,
            "--data", REPO / "data" / "builtin-rl", "--out-dir", ours_dir]


def training_prompts(bucket_len):
    """The flags as fsdp2_grpo.py parses them, and the prompts (token ids) and answers of its training split: read
    here with its very flags, so they are the ones it trains on."""
    parser = common.get_parser("", str(ours_dir))
    for flag, kind in [("--eval-generate", int), ("--group-size", int), ("--prompts-per-step", int), ("--data", str),
                       ("--init-from", str)]:
        parser.add_argument(flag, type=kind)  # its own flags
    parser.add_argument("--reward", default="final-number")
    argv = [str(flag) for flag in grpo_flags(bucket_len)]
    args = common.finalize_args(common.parse_args(parser, loading.script_presets("fsdp2_grpo.py"), argv), None)
    train, _ = data.load_sft_data(args)
    prompts, answers, _ = grading.answer_prompts(chat_tokenizer, train, len(train.lengths), args.reward)
    return args, prompts, answers


# A bucket too large to cut any conversation finds the longest prompt; the real bucket adds the reply bound to it.
_, prompts, _ = training_prompts(4096)
bucket_len = max(map(len, prompts)) + cli.max_reply_tokens
args, prompts, answers = training_prompts(bucket_len)
# Each step's prompts as fsdp2_grpo.py takes them (its prompt_schedule, world size 1), epoch after epoch.
step_prompts, epoch = [], 0
while len(step_prompts) < cli.steps:
    schedule = data.epoch_schedule(np.ones(len(prompts), dtype=np.int64), [1], args.prompts_per_step, 1, 1,
                                   args.seed, epoch)
    step_prompts += [[int(i) for i in schedule[s][1]] for s in range(len(schedule))]
    epoch += 1
step_prompts = step_prompts[:cli.steps]
if any(len(step) != cli.prompts_per_step for step in step_prompts):  # TRL's sampler takes whole batches only
    sys.exit(f"--steps {cli.steps} reaches the short last step of an epoch ({len(prompts)} prompts): use fewer")


def measure_ours():
    """Run fsdp2_grpo.py; its figures from its metrics rows."""
    command = [sys.executable, "fsdp2_grpo.py", *map(str, grpo_flags(bucket_len))]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (ours_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if "loss" in row}
    timed = range(cli.skip + 1, cli.steps + 1)
    rollout_seconds = [steps[s]["rollout_s"] for s in timed]
    step_seconds = [steps[s]["elapsed_s"] - steps[s - 1]["elapsed_s"] for s in timed]  # wall time, the whole loop
    return {"replies_per_s": replies_per_step * len(timed) / sum(rollout_seconds),
            "steps_per_s": len(timed) / sum(step_seconds), "rollout_seconds": rollout_seconds,
            "step_seconds": step_seconds, "reward": float(np.mean([row["reward"] for row in steps.values()])),
            "reply_tokens": float(np.mean([row["reply_tokens"] for row in steps.values()])), "out": str(ours_dir)}


def measure_trl():
    """TRL's GRPOTrainer on the exported checkpoint, the prompts as text in our chat format, in ours' step order."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # TRL 1.16 still calls transformers' gradient_checkpointing_* names around every generation: their warnings.
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)

    command = [sys.executable, "export_hf.py", str(checkpoint_dir), str(hf_dir)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stderr[-3000:]}")
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    # Prompts as text (ours' token ids decoded: <|system|>...<|end_of_turn|><|user|>...<|assistant|>), not through a
    # chat template. TRL tokenizes them with the exported tokenizer, which must give back ours' ids exactly: check.
    rows = [i for step in step_prompts for i in step]
    texts = [chat_tokenizer.decode(prompts[i]) for i in rows]
    if hf_tokenizer(text=texts)["input_ids"] != [prompts[i] for i in rows]:
        sys.exit(f"the tokenizer in {hf_dir} does not give back our prompts' token ids: TRL would see other prompts")
    dataset = datasets.Dataset.from_dict({"prompt": texts, "answer": [answers[i] for i in rows],
                                          "prompt_tokens": [len(prompts[i]) for i in rows]})

    def answer_reward(completion_ids, answer, **kwargs):
        """1 where the reply answers the reference answer as ours reads replies (grading.reply_answer), else 0."""
        return [float(grading.reply_answer(chat_tokenizer, ids, args.reward) == reference)
                for ids, reference in zip(completion_ids, answer)]

    rollout_seconds = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            # Ours' bound: the bucket less the step's longest prompt (more than --max-reply-tokens where it is short).
            self.generation_config.max_new_tokens = bucket_len - max(row["prompt_tokens"] for row in inputs)
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            rollout_seconds.append(time.perf_counter() - start)
            return output

    class StepClock(TrainerCallback):
        def __init__(self):
            self.step_ends = []

        def on_step_end(self, training_args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(trl_dir), max_steps=cli.steps, seed=cli.seed, use_cpu=True, bf16=False, fp16=False,
        # One generation batch of prompts x group size replies per optimizer step, trained in one micro-batch, in
        # the dataset's order (ours' step order): as ours.
        per_device_train_batch_size=replies_per_step, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=cli.group_size, shuffle_dataset=False, num_iterations=1,
        max_completion_length=cli.max_reply_tokens, temperature=1.0, top_k=0, top_p=1.0,
        beta=0.0, scale_rewards="none", mask_truncated_completions=False,
        # "dapo" divides the summed token losses by the step's reply tokens: ours' normalization. ("dr_grpo" divides
        # by replies x max_completion_length, a constant; "grpo" averages each reply first; "bnpo" is dapo per
        # micro-batch, the same here.) On-policy its ratio is 1, so its gradient is advantage x grad cross-entropy.
        loss_type="dapo",
        activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False},
        optim="adamw_torch_fused", learning_rate=cli.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        max_grad_norm=args.grad_clip, logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        dataloader_num_workers=0, disable_tqdm=True)
    clock = StepClock()
    trainer = TimedGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                               reward_funcs=[answer_reward], args=config, train_dataset=dataset,
                               processing_class=hf_tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # its dict of every metric at every step; the table says what we need
    trainer.train()
    if len(rollout_seconds) != cli.steps or len(clock.step_ends) != cli.steps:
        sys.exit(f"TRL generated {len(rollout_seconds)} times in {len(clock.step_ends)} steps: expected one per step")
    logged = [row for row in trainer.state.log_history if "reward" in row]  # one row per step (logging_steps=1)
    step_seconds = np.diff(clock.step_ends[cli.skip - 1:]).tolist()
    return {"replies_per_s": replies_per_step * len(step_seconds) / sum(rollout_seconds[cli.skip:]),
            "steps_per_s": len(step_seconds) / sum(step_seconds), "rollout_seconds": rollout_seconds[cli.skip:],
            "step_seconds": step_seconds, "reward": float(np.mean([row["reward"] for row in logged])),
            "reply_tokens": float(np.mean([row["completions/mean_length"] for row in logged])), "out": str(trl_dir)}


started = datetime.datetime.now()
device = f"CPU ({platform.machine()}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads)"
results = {"date": started.date().isoformat(), "device": device, "command": " ".join(sys.argv),
           "versions": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "trl")},
           "settings": {"checkpoint": str(checkpoint_dir), "model": preset, "steps": cli.steps, "skip": cli.skip,
                        "prompts_per_step": cli.prompts_per_step, "group_size": cli.group_size,
                        "replies_per_step": replies_per_step, "max_reply_tokens": cli.max_reply_tokens,
                        "bucket_len": bucket_len, "lr": cli.lr, "seed": cli.seed, "training_prompts": len(prompts)},
           "step_prompts": step_prompts, "work_dir": str(work)}
print(f"fsdp2_grpo.py: {cli.steps} steps ...", flush=True)
results["fsdp2_grpo.py"] = measure_ours()
print(f"TRL GRPOTrainer: {cli.steps} steps ...", flush=True)
results["TRL GRPOTrainer"] = measure_trl()

print(f"\n{results['device']}; '{preset}' from {checkpoint_dir}; {cli.prompts_per_step} prompts x {cli.group_size} "
      f"replies per step, bucket {bucket_len}; speed over steps {cli.skip + 1}-{cli.steps}, reward and reply length "
      f"over steps 1-{cli.steps}: {results['date']}\n")
print("| tool | steps timed | replies per step | replies/s (rollout) | optimizer steps/s | mean reward "
      "| mean reply tokens | max reply tokens |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for name in ("fsdp2_grpo.py", "TRL GRPOTrainer"):
    row = results[name]
    print(f"| {name} | {cli.steps - cli.skip} | {replies_per_step} | {row['replies_per_s']:.1f} | "
          f"{row['steps_per_s']:.3f} | {row['reward']:.3f} | {row['reply_tokens']:.1f} | {cli.max_reply_tokens} |")
ours, theirs = results["fsdp2_grpo.py"], results["TRL GRPOTrainer"]
print(f"\nfsdp2_grpo.py / TRL GRPOTrainer: {ours['replies_per_s'] / theirs['replies_per_s']:.2f}x replies/s, "
      f"{ours['steps_per_s'] / theirs['steps_per_s']:.2f}x optimizer steps/s")
Path(cli.out).write_text(json.dumps(results, indent=2))
print(f"written: {cli.out}")
