"""The whole pipeline in one command: pretraining -> midtraining -> SFT -> GRPO (beside its control and a reference)
-> evaluate.py -> plots -> a report.

    python pipeline.py                                        # small model, built-in data, 2 processes (BENCHMARKS.md)
    python pipeline.py --seed 1 --out-dir runs/pipeline_seed1
    python pipeline.py --stages eval                          # score the runs already in --out-dir again
    python pipeline.py --model qwen2-0.5b --nproc 8 --pretrain-data data/fineweb-edu --sft-data data/openthoughts \\
        --rl-data data/gsm8k

Each stage runs its script under torchrun with --out-dir DIR/<stage>, starting from the stage before it:

    pretrain  fsdp2_pretrain.py
    data      python prepare_data.py, where a stage reads a built-in set (--*-data left at data/builtin*)
    mid       fsdp2_pretrain.py from pretrain's newest checkpoint, on its text and --mid-data's conversations 70:30
    sft       fsdp2_sft.py from mid's newest checkpoint, with 10% of its tokens pretraining text replayed
    grpo      fsdp2_grpo.py from sft's newest checkpoint, on problems with answers only (--reward final-number on
              --rl-data other than the built-in problems, as GSM8K's numbers)
    control   fsdp2_sft.py from sft's newest checkpoint, for as long as grpo took: the SFT continued on its own data at
              its final learning rate, the compute-matched baseline GRPO must beat
    reference fsdp2_sft.py as the SFT, on the built-in set with every solve row worked (DIR/reference.jsonl): what
              imitation reaches when told which mode to use (built-in SFT data only; skipped otherwise)
    eval      evaluate.py on each stage's newest checkpoint -> DIR/eval.jsonl (each row with its stage), plot.py ->
              DIR/pretrain.png, sft.png and grpo.png (beside the control), and DIR/report.md: the command, commit,
              date and torch version that made it, each stage's command (DIR/stages.json), the stage table with 95%
              intervals, and what GRPO gained

Flags this command does not know go to every training script (e.g. --dtype bf16, --compile).
"""
import argparse
import datetime
import importlib.metadata
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import checkpoints
import common
import plot
import prepare_data
import tasks

REPO = Path(__file__).resolve().parent

STAGES = ["pretrain", "mid", "sft", "grpo", "control", "reference", "eval"]
SCRIPTS = {"pretrain": "fsdp2_pretrain.py", "mid": "fsdp2_pretrain.py", "sft": "fsdp2_sft.py", "grpo": "fsdp2_grpo.py",
           "control": "fsdp2_sft.py", "reference": "fsdp2_sft.py"}
RUN_IT = "run its stage first (--stages)"  # what a stage's unreadable metrics.jsonl asks for
SOURCES = {"mid": "pretrain", "sft": "mid", "grpo": "sft", "control": "sft", "reference": "mid"}  # each starts from
# Midtraining: pretraining text and the built-in conversations 70:30 (by tokens), from pretraining's weights, the LR
# warmed up again, held, then decayed over its last fifth; (steps, warmup steps) per preset. The SFT replays
# pretraining text, so as to keep its prose, and saves 4 times for the abilities figure (docs/pipeline.md, measured).
MID_SCHEDULE = {"tiny": (20, 2), "small": (30, 3), "qwen2-0.5b": (1000, 50)}
MID_TEXT_SHARE, SFT_REPLAY_SHARE = 0.7, 0.1
SFT_SAVE_EVERY = {"tiny": 5, "small": 375, "qwen2-0.5b": 500}  # a quarter of fsdp2_sft.py's steps per preset
# GRPO trains on the first task's lengths; the second's are longer; the third is the SFT's arithmetic. The first two
# are also sampled 8 times per problem, after the SFT and after GRPO: pass@k and the share of replies worked.
COMPARED, SAMPLED = ["solve", "solve_long", "arith_gen"], ["solve", "solve_long"]
DATA = {"pretrain": ("data/builtin", "pretraining text"), "mid": ("data/builtin-sft", "conversations midtraining "
        "reads as text"), "sft": ("data/builtin-sft", "SFT conversations (also the control's)"),
        "rl": ("data/builtin-rl", "GRPO's problems")}  # --<stage>-data: its default folder, what it holds


class StageFailed(common.ReportedError):
    """A stage's script exited with an error: the pipeline stops there. Exit status 5."""
    exit_status = 5


def stage_list(text):
    stages = [stage.strip() for stage in text.split(",") if stage.strip()]
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown or not stages:
        raise argparse.ArgumentTypeError(f"unknown stage {', '.join(unknown) or '(none)'}: choose from "
                                         f"{', '.join(STAGES)}")
    return [stage for stage in STAGES if stage in stages]  # always in pipeline order


def get_parser():
    parser = common.ArgumentParser(__doc__)
    parser.add_argument("--stages", type=stage_list, default=",".join(STAGES), help="comma-separated, of " +
                        ", ".join(STAGES))
    parser.add_argument("--out-dir", default="runs/pipeline", help="each stage's run goes to a folder here")
    parser.add_argument("--seed", type=common.NON_NEGATIVE_INT, default=1337, help="every stage's --seed")
    parser.add_argument("--model", default="small", choices=list(common.MODEL_PRESETS), help="every stage's --model")
    parser.add_argument("--nproc", type=common.COUNT, default=2, help="processes per stage (torchrun's "
                        "--nproc_per_node): one per GPU, or per pair of CPU cores")
    parser.add_argument("--eval-limit", type=common.COUNT, default=200, help="evaluate.py's --limit: problems or "
                        "documents per task")
    for stage, (folder, what) in DATA.items():
        parser.add_argument(f"--{stage}-data", default=folder, help=f"the prepared folder of the {what}")
    return parser


def provenance():
    """What reproduces this invocation: its exact command (every flag), the checkout's commit, the date, torch's
    version."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        commit += " with local changes" * bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        commit = "unknown (not a git checkout)"
    return {"pipeline": shlex.join(["python", "pipeline.py", *sys.argv[1:]]), "commit": commit,
            "date": datetime.date.today().isoformat(), "torch": importlib.metadata.version("torch")}


def holds_builtin_set(folder):
    """Whether a prepared folder holds a built-in set (prepare_data.py --data builtin); stages run in the checkout."""
    try:
        return json.loads((REPO / folder / "meta.json").read_text())["source"]["data"] == "builtin"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def source_of(stage, args):
    """The run a stage starts from: SOURCES', but the SFT (and its reference) start from pretraining when there is no
    midtraining."""
    mid_ran = "mid" in args.stages or (Path(args.out_dir) / "mid" / "checkpoints").is_dir()
    return "pretrain" if stage in ("sft", "reference") and not mid_ran else SOURCES.get(stage)


def stage_flags(stage, args):
    """The flags the pipeline gives a stage, before the user's own (which win): midtraining's mixture and schedule,
    the SFT's replay, GRPO's reward on data other than the built-in set, and every checkpoint kept (evaluate.py reads
    them all)."""
    flags = ["--keep-last", "1000"]
    if stage == "mid":
        steps, warmup = MID_SCHEDULE[args.model]
        flags += ["--data", f"{args.pretrain_data}:{MID_TEXT_SHARE}", f"{args.mid_data}:{1 - MID_TEXT_SHARE:g}",
                  "--lr-schedule", "wsd", "--decay-fraction", "0.2", "--max-steps", str(steps), "--warmup-steps",
                  str(warmup), "--save-every", str(steps // 2), "--eval-every", str(steps // 4)]
    if stage == "grpo" and not holds_builtin_set(args.rl_data):  # as GSM8K's: a number to match, not a reply's text
        flags += ["--reward", "final-number"]
    if stage in ("sft", "reference"):  # (the control continues the SFT with its flags: control_flags)
        flags += ["--replay", f"{args.pretrain_data}:{SFT_REPLAY_SHARE}", "--save-every",
                  str(SFT_SAVE_EVERY[args.model])]
    return flags


def run_stage(stage, args, extra):
    """Run one training stage under torchrun; returns its wall-clock seconds and its command. A failed stage stops the
    pipeline."""
    out = Path(args.out_dir) / stage
    flags = ["--model", args.model, "--seed", str(args.seed), "--out-dir", str(out), "--resume", "auto",  # (a rerun)
             *stage_flags(stage, args), *extra]
    if stage == "reference":  # the built-in SFT set, every solve row worked, prepared beside the runs
        flags += ["--data", str(prepare_reference(out.parent))]
    elif stage != "mid":
        flags += ["--data", {"pretrain": args.pretrain_data, "grpo": args.rl_data}.get(stage, args.sft_data)]
    if source_of(stage, args):
        flags += ["--init-from", str(Path(args.out_dir) / source_of(stage, args))]
    if stage == "control":
        flags += control_flags(Path(args.out_dir))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               SCRIPTS[stage], *flags]
    return run_command(stage, command, shlex.join(["torchrun", *command[3:]]))  # shown as a user would type it


def run_command(stage, command, shown):
    """Run a stage's command in the checkout, as shown; returns its wall-clock seconds and the command shown. A failed
    stage stops the pipeline; a stop signal is passed on to the stage, which saves its step and stops, and so do we."""
    print(f"\n== {stage}: {shown}", flush=True)
    started, signalled = time.perf_counter(), []
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True)  # a terminal's Ctrl-C reaches it through us
    handlers = {signum: signal.signal(signum, lambda signum, frame: signalled.append(process.send_signal(signum)))
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    status = process.wait()
    for signum, handler in handlers.items():  # ours again between stages, as evaluation and the report run here
        signal.signal(signum, handler)
    rerun = f" with --stages {','.join(STAGES[STAGES.index(stage):])}" if stage in STAGES else ""
    if signalled:  # the training stages run with --resume auto: the rerun continues this one from its saved step
        print(f"stopped by a signal in the {stage} stage: rerun{rerun} to continue", flush=True)
        raise SystemExit(common.STOPPED_BY_SIGNAL)
    if status != 0:
        raise StageFailed(f"the {stage} stage failed with exit status {status} (docs/errors.md; its output is above): "
                          f"fix it, then rerun{rerun}")
    return time.perf_counter() - started, shown


def prepare_reference(out_dir):
    """The reference stage's data: the built-in SFT set with every solve row worked, written (once: a folder that
    holds it is kept) as out_dir/reference.jsonl and prepared into out_dir/reference-data."""
    rows = "".join(json.dumps(record) + "\n" for record in tasks.builtin_sft_records(worked_share=1.0))
    source, folder = out_dir / "reference.jsonl", out_dir / "reference-data"
    if not source.is_file() or source.read_text() != rows:
        out_dir.mkdir(parents=True, exist_ok=True)
        source.write_text(rows)
        shutil.rmtree(folder, ignore_errors=True)  # prepared from the rows replaced
    args = argparse.Namespace(data=str(source), data_config=None, text_field="text", max_docs=0)
    prepare_data.prepare(args, "sft", folder, workers=1, progress=False)
    return folder


def control_flags(out_dir):
    """The control: as many SFT steps as fit in GRPO's training time at the SFT's own pace (both timed from their
    first step to their last, start-up and evaluation included), at the SFT's final learning rate, held."""
    sft_rows = [row for row in plot.read_metrics(out_dir / "sft", RUN_IT) if "elapsed_s" in row]
    grpo_rows = [row for row in plot.read_metrics(out_dir / "grpo", RUN_IT) if "elapsed_s" in row]
    if not sft_rows or not grpo_rows:
        raise common.UsageError(f"{out_dir}: the sft and grpo runs logged no steps: run those stages first")
    seconds_per_step = sft_rows[-1]["elapsed_s"] / sft_rows[-1]["step"]
    steps = max(1, round(grpo_rows[-1]["elapsed_s"] / seconds_per_step))
    flags = json.loads((out_dir / "sft" / "config.json").read_text())["flags"]
    final_lr = flags["lr"] * flags["min_lr_ratio"]
    return ["--max-steps", str(steps), "--lr", f"{final_lr:.6g}", "--min-lr-ratio", "1", "--warmup-steps", "0",
            "--save-every", str(steps), *(["--replay", flags["replay"]] if flags.get("replay") else [])]


def evaluate_stages(out_dir, stages, args):
    """evaluate.py on every checkpoint of each run (its newest on every task, the others on the abilities the figure
    draws); its rows, each with its stage, whether it is the run's newest, the training tokens the stages before it
    had seen (stage_start), and those it and they had seen at that checkpoint."""
    import evaluate

    rows, seen = [], {}  # seen: the tokens each run had trained on when it ended
    for stage in stages:
        source = source_of(stage, args)
        steps = [row for row in plot.read_metrics(out_dir / stage, RUN_IT) if "loss" in row]
        run_tokens = dict(zip([row["step"] for row in steps], np.cumsum([row["tokens"] for row in steps])))
        before = seen.get(source, 0) if source in stages else 0
        seen[stage] = before + (int(max(run_tokens.values())) if run_tokens else 0)
        found = checkpoints.complete_checkpoints(out_dir / stage / "checkpoints")
        for checkpoint_dir in found:
            newest = checkpoint_dir == found[-1]
            command = [str(checkpoint_dir), "--limit", str(args.eval_limit)]
            commands = [command + ["--tasks", ",".join(task for task in evaluate.TASKS if task not in SAMPLED)],
                        command + ["--tasks", ",".join(SAMPLED), "--samples", "8"]]
            if not (newest and stage in ("sft", "grpo")):
                commands = [command]
            if not newest:  # of the abilities the figure draws, those this model can do
                chat = checkpoints.read_meta(checkpoint_dir, "checkpoint").get("chat_format")
                commands = [command + ["--tasks", ",".join(task for task, _, _ in plot.ABILITIES
                                                           if chat or task not in evaluate.CHAT_TASKS)]]
            for command in commands:
                print(f"\n== eval: python evaluate.py {shlex.join(command)}", flush=True)
                step = int(checkpoint_dir.name[5:])
                rows += [{"stage": stage, "newest": newest, "stage_start": before,
                          "tokens": before + int(run_tokens.get(step, 0)), **row}
                         for row in evaluate.evaluate(evaluate.get_parser().parse_args(command))]
    return rows


def cell(row):
    """A figure and its interval, as README's tables write them: 2.46 [2.24, 2.68], or 61.0% [54.1, 67.5]."""
    if row is None:
        return ""
    if row["metric"] == "bpb":
        return f"{row['value']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"
    return f"{100 * row['value']:.1f}% [{100 * row['ci_low']:.1f}, {100 * row['ci_high']:.1f}]"


def report(rows, stages, runs, now, out_dir):
    """DIR/report.md: how it was made, each stage's command, the stage table with intervals, GRPO's gains against the
    SFT, the control and the reference, and the sampled replies before and after GRPO."""
    found = {(row["stage"], row["task"], row["metric"]): row for row in rows if row["newest"]}
    measured = [(task, metric) for task, metric in dict.fromkeys((row["task"], row["metric"]) for row in rows)
                if metric in ("bpb", "accuracy", "worked")]
    lines = ["# Pipeline report", "", f"Written by `{now['pipeline']}` at commit {now['commit']}, {now['date']}, torch "
             f"{now['torch']}. Each stage ran as below (its every flag), under the `pipeline.py` command beside it, "
             f"which reproduces it:", "", "| stage | seconds | command | run by |", "| --- | --- | --- | --- |"]
    lines += [f"| {stage} | {run['seconds']:.0f} | `{run['command']}` | `{run['pipeline']}` at {run['commit']}, "
              f"{run['date']}, torch {run['torch']} |" for stage, run in runs.items()]
    lines += ["", f"Each figure: `evaluate.py` on the stage's newest checkpoint, with its 95% interval (n per task: "
              f"{', '.join(sorted({str(row['n']) for row in rows}))}).", "",
              "| task: metric | " + " | ".join(stages) + " |", "| --- |" + " --- |" * len(stages)]
    lines += [f"| `{task}`: {metric} | " + " | ".join(cell(found.get((stage, task, metric))) for stage in stages) + " |"
              for task, metric in measured]
    accuracy = {(stage, task): found.get((stage, task, "accuracy")) for stage in stages for task in COMPARED}
    if all(accuracy.get((stage, task)) for stage in ("sft", "grpo", "control") for task in COMPARED):
        lines += ["", "## GRPO against the SFT it starts from, the compute-matched control and the reference", "",
                  "| task | SFT | GRPO | control | reference | GRPO - SFT | GRPO above the control, intervals apart |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for task in COMPARED:
            sft, grpo, control, reference = (accuracy.get((stage, task)) for stage in ("sft", "grpo", "control",
                                                                                        "reference"))
            apart = grpo["ci_low"] > control["ci_high"]
            lines.append(f"| `{task}` | {cell(sft)} | {cell(grpo)} | {cell(control)} | {cell(reference)} | "
                         f"{100 * (grpo['value'] - sft['value']):+.1f} points | {'yes' if apart else 'no'} |")
    sampled = [(task, metric) for task, metric in dict.fromkeys((row["task"], row["metric"]) for row in rows)
               if task in SAMPLED and (metric.startswith("pass@") or metric == "sampled_worked")]
    if sampled:
        lines += ["", "## Eight replies sampled per problem (temperature 1), after the SFT and after GRPO", "",
                  "| task: metric | SFT | GRPO |", "| --- | --- | --- |"]
        lines += [f"| `{task}`: {metric} | {cell(found.get(('sft', task, metric)))} | "
                  f"{cell(found.get(('grpo', task, metric)))} |" for task, metric in sampled]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main():
    args, extra = get_parser().parse_known_args()
    out_dir, now = Path(args.out_dir), provenance()
    with common.lock_folder(out_dir, "--out-dir"):  # one pipeline per folder (each stage locks its own)
        stage_runs_file = out_dir / "stages.json"  # each stage's command and seconds, kept across invocations
        stage_runs = json.loads(stage_runs_file.read_text()) if stage_runs_file.is_file() else {}
        training = [stage for stage in args.stages if stage in SCRIPTS]
        if training and any(getattr(args, f"{stage}_data") == folder for stage, (folder, _) in DATA.items()):
            run_command("data", [sys.executable, "prepare_data.py"], "python prepare_data.py")  # keeps what it wrote
        for stage in training:
            if stage == "reference" and not holds_builtin_set(args.sft_data):
                print("\n== reference: skipped (it is the built-in SFT set with every solve row worked)", flush=True)
                continue
            seconds, command = run_stage(stage, args, extra)
            stage_runs[stage] = {"seconds": seconds, "command": command, **now}
            stage_runs_file.write_text(json.dumps(stage_runs, indent=2))
        if "eval" not in args.stages:
            return
        stages = [stage for stage in SCRIPTS if (out_dir / stage / "checkpoints").is_dir()]
        if not stages:
            raise common.UsageError(f"--out-dir {out_dir} holds no stage's checkpoints: run the training stages first")
        rows = evaluate_stages(out_dir, stages, args)
        (out_dir / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        plots = {"pretrain": ["pretrain", "mid"], "sft": ["sft", "reference"], "grpo": ["grpo", "control"]}
        plots = {name: [out_dir / stage for stage in runs if stage in stages] for name, runs in plots.items()}
        for name, runs in plots.items():
            if runs:
                plot.plot(runs, out_dir / f"{name}.png")
        plot.plot_abilities(rows, out_dir / "abilities.png")
        print(f"\nwrote {report(rows, stages, stage_runs, now, out_dir)}, {out_dir / 'eval.jsonl'} and the plots "
              f"{', '.join(f'{name}.png' for name, runs in plots.items() if runs)}, abilities.png")


if __name__ == "__main__":
    main()
