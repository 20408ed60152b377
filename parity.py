"""Does every strategy train exactly as DDP does (or, where no other script trains alike, as itself on one
process)? Each pretraining script and its variants, from one seed on one data order with the same global batch (tiny
preset, fp32, CPU, gloo, buckets 32, 64 and 128 shortest first), against that reference ("ref" in the columns) step
by step: one table, parity.json and parity.png (the loss curves overlaid; the differences on a log axis beside them).

    python parity.py                                    # every row at world 2 and 4, Muon's at 3, the 3D script's at 8
    python parity.py --scripts my_fork.py --world 2     # did my change keep training exact? (any script taking the
                                                        # common flags)
    python parity.py --scripts my_ep_fork.py --model tiny-moe --against-itself one-batch   # a fork of the MoE script

A row runs its script on `world` ranks with --grad-accum making up the ranks that read the same samples (tp, cp, pp),
so each step takes world batches, as DDP's reference of that world does (DDP on 2 processes, --grad-accum world / 2,
made once per world). An AGAINST_ITSELF row's reference is its own script on one process, taking a step's batches as
micro-batches (Muon, at world 3 too: rows that split unevenly) or as one batch (the MoE script, whose balance loss is
over each micro-batch of all ranks); only such a row takes an odd world. A row of world W runs --steps x 2 / W steps,
the samples of --steps at world 2. Exit status 1 when a row's loss, gradient norm or validation loss differs from its
reference's by more than --tolerance (a one-batch reference's: --one-batch-tolerance; relative above 1) or is not a
number at some step, when it trains fewer buckets than DDP or no step past the warmup, or a run fails: one line per
such row, naming it and the columns. A finished run is reused while its command, its code (the script and every module
it imports), its data, Python's and the libraries' versions and the device are the same.
"""
import ast
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
import plot

REPO = Path(__file__).resolve().parent
# name: (script, its flags, the ranks that read the same samples: world / this = the data-parallel degree, the worlds)
ROWS = {
    "fsdp1": ("fsdp1_pretrain.py", [], 1, (2, 4)),
    "fsdp2": ("fsdp2_pretrain.py", [], 1, (2, 4)),
    "fsdp2 ZeRO-2": ("fsdp2_pretrain.py", ["--reshard-after-forward", "false"], 1, (2, 4)),
    "tp 2": ("fsdp2_tp_pretrain.py", ["--tp", "2"], 2, (2, 4)),
    "cp 2": ("fsdp2_cp_pretrain.py", ["--cp", "2"], 2, (2, 4)),
    "pp 2 GPipe": ("pp_pretrain.py", ["--pp", "2", "--pp-schedule", "gpipe"], 2, (2, 4)),
    "pp 2 1F1B": ("pp_pretrain.py", ["--pp", "2", "--pp-schedule", "1f1b"], 2, (2, 4)),
    "3d replicate 2": ("fsdp2_3d_pretrain.py", ["--dp-replicate", "2"], 1, (2, 4)),
    "3d cp 2 x tp 2": ("fsdp2_3d_pretrain.py", ["--cp", "2", "--tp", "2"], 4, (4,)),
    "3d 2 x 2 x 2": ("fsdp2_3d_pretrain.py", ["--dp-replicate", "2", "--cp", "2", "--tp", "2"], 4, (8,)),
    "muon": ("fsdp2_muon_pretrain.py", [], 1, (2, 3, 4)),  # against its own world 1 (AGAINST_ITSELF): 3, uneven rows
    "ep 2": ("fsdp2_ep_pretrain.py", ["--model", "tiny-moe", "--ep", "2"], 1, (2, 4)),  # a Mixture of Experts, too
    "ep 4": ("fsdp2_ep_pretrain.py", ["--model", "tiny-moe", "--ep", "4"], 1, (4,)),
}
# Rows whose reference is their own script on one process, not DDP (training that no other script's matches), and how
# that process takes a step's batches: as micro-batches (--grad-accum), or as one batch (--tokens-per-batch).
AGAINST_ITSELF = {"muon": "micro-batches", "ep 2": "one-batch", "ep 4": "one-batch"}
COMPARED = ["max |loss - ref|", "max |grad norm - ref|", "max |val loss - ref|"]  # each within --tolerance
COLUMNS = [*COMPARED, "val loss", "buckets", "seconds"]
BUCKETS = "32,64,128"  # few, so that the last one comes early: every world size trains each of them


def parse_args(argv=None):
    parser = common.ArgumentParser(__doc__)
    parser.add_argument("--scripts", nargs="+", default=None, help="instead of the rows above: these scripts, each "
                        "as one row with no flags of its own (a fork of a pretraining script)")
    parser.add_argument("--world", type=common.COUNT, nargs="+", default=None, help="the world sizes to run (default: "
                        "each row's own; with --scripts, 2), each even, or any against a script's own world 1 (a row "
                        "that lists it, --scripts with --against-itself; 1 with --scripts)")
    parser.add_argument("--steps", type=common.COUNT, default=24, help="steps at world 2 (world W: x 2 / W): the "
                        "buckets come shortest first, and on the built-in data every world size reaches the last and "
                        "trains beyond the warmup (5 steps)")
    parser.add_argument("--model", default="tiny", help="with --scripts: the preset every run takes (the rows: tiny, "
                        "or their own)")
    parser.add_argument("--against-itself", choices=["micro-batches", "one-batch"], default=None, help="with "
                        "--scripts: the reference is each script on one process, a step's batches as its micro-batches "
                        "or as one batch (default: DDP's)")
    parser.add_argument("--data", default="data/builtin", help="a prepared folder (`python prepare_data.py`)")
    parser.add_argument("--one-batch-tolerance", type=common.number(float, 0), default=1e-4, help="the same, for a row "
                        "whose reference takes the step as one batch: it sums each gradient over all tokens at once, "
                        "not as the ranks' partial sums, and fp32 rounds that sum differently where it nearly cancels")
    parser.add_argument("--tolerance", type=common.number(float, 0), default=1e-5, help="the largest difference from "
                        "its reference a row may show in loss, grad norm or validation loss (relative above 1)")
    parser.add_argument("--out-dir", default="runs/parity", help="the runs, parity.json and parity.png go here")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="every run's (bf16: see "
                        "docs/parity.md for the tolerance it meets)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the runs on this machine's "
                        "GPUs, a rank each (NCCL)")
    args = parser.parse_args(argv)
    against_itself = ({1, *(args.world if args.against_itself else [])} if args.scripts else
                      {world for name in AGAINST_ITSELF for world in ROWS[name][3]})  # odd worlds they may take
    if any(world % 2 and world not in against_itself for world in args.world or []):
        raise common.UsageError(f"--world {' '.join(map(str, args.world))}: every world size must be even (DDP's "
                                f"reference runs on 2 processes), or odd where the rows are against their own world 1 "
                                f"({', '.join(str(w) for w in sorted(against_itself) if w % 2)}; --scripts with "
                                f"--against-itself: any): change --world")
    for script in args.scripts or []:
        if not Path(script).is_file():
            raise common.UsageError(f"--scripts {script}: no such file: pass a script's path")
    args.scripts = args.scripts and [str(Path(script).resolve()) for script in args.scripts]  # run from the checkout
    if not (Path(args.data) / "meta.json").is_file():
        raise common.UsageError(f"--data {args.data} is no prepared folder: run `python prepare_data.py` first, or "
                                f"pass one it wrote")
    args.data, args.out_dir = str(Path(args.data).resolve()), str(Path(args.out_dir).resolve())  # the runs' cwd: REPO
    return args


def planned_rows(args):
    """[(name, script, flags, the ranks that read the same samples, world)] to run against their reference (DDP's, or
    AGAINST_ITSELF's), in table order."""
    if args.scripts:
        return [(Path(script).name, script, ["--model", args.model], 1, world) for script in args.scripts
                for world in args.world or [2]]
    rows = []
    for world in sorted({w for *_, worlds in ROWS.values() for w in worlds} if args.world is None else args.world):
        rows += [(name, script, flags, divisor, world) for name, (script, flags, divisor, worlds) in ROWS.items()
                 if (world in worlds if args.world is None or world % 2 else world % divisor == 0)]
    return rows


def sources(script):
    """{path: sha256} of SCRIPT and of every module it imports from its own folder or this checkout, through each
    other too: the code that decides its numbers."""
    found, todo = {}, [Path(script).resolve()]
    while todo:
        path = todo.pop()
        if str(path) not in found:
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            nodes = list(ast.walk(ast.parse(path.read_bytes())))
            names = [alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names]
            names += [node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module]
            todo += [folder / f"{name.split('.')[0]}.py" for name in names for folder in (path.parent, REPO)
                     if (folder / f"{name.split('.')[0]}.py").is_file()]
    return found


def run_key(script, command, args):
    """What a finished run is reused for: the same command (the dtype is a flag), code (sources), data (its prepared
    content's sha256), Python and libraries, and device."""
    meta = Path(args.data) / "meta.json"
    gpu = None
    if args.device == "cuda":
        import torch  # only here: the rows run in their own processes
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"command": command, "sources": sources(REPO / script), "python": sys.version,
            "data": json.loads(meta.read_text()).get("content_sha256") if meta.is_file() else None,
            "versions": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "numpy")},
            "device": args.device, "gpu": gpu}


def run(script, flags, nproc, steps, out_dir, args):
    """SCRIPT on NPROC ranks under torchrun into OUT_DIR, unless OUT_DIR holds a finished run of the same run_key:
    (seconds, exit status, the last line of its error output, whether it was reused)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
               *([] if "--model" in flags else ["--model", "tiny"]), "--dtype", args.dtype, "--data", args.data,
               "--max-steps", str(steps),
               "--eval-every", str(steps), "--save-every", str(steps), "--buckets", BUCKETS, "--bucket-order",
               "ascending", "--val-fraction", "0.002", *flags, "--out-dir", str(out_dir)]
    done, key = out_dir / "parity-run.json", run_key(script, command[1:], args)
    if done.is_file() and json.loads(done.read_text()) == key:
        return json.loads((out_dir / "parity-seconds.json").read_text()), 0, "", True
    shutil.rmtree(out_dir, ignore_errors=True)  # a run that failed or ran another command
    start = time.perf_counter()
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # a fork elsewhere too
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path,
           **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode == 0:
        (out_dir / "parity-seconds.json").write_text(json.dumps(seconds))
        done.write_text(json.dumps(key))
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")] or [line for line in lines if "Error" in line]
    return seconds, result.returncode, (errors or lines or [""])[-1].strip(), False


def read_steps(out_dir):
    """{step: row} of a run's training rows and {step: validation loss} (plot.py's reader: a line cut short is
    skipped)."""
    rows = plot.read_metrics(out_dir, "see the run's own error")
    return ({row["step"]: row for row in rows if "loss" in row},
            {row["step"]: row["val_loss"] for row in rows if "val_loss" in row})


def difference(value, reference):
    return abs(value - reference) / max(1.0, abs(reference))


def largest(differences):
    """The largest difference; NaN where any is NaN (max() would drop a NaN after the first element)."""
    differences = list(differences)
    return math.nan if any(map(math.isnan, differences)) else max(differences, default=math.inf)


def compare(out_dir, reference_dir, steps=None):
    """{column: value} of a run against its reference (DDP's, or its own) over STEPS (default: every step the reference
    logged): the largest loss, grad norm and validation loss differences (relative where the reference's value is
    above 1; a step the run did not log, or logged in another bucket, counts as infinite), its last validation loss,
    and the buckets its steps and the reference's trained ("ref buckets")."""
    (train, val), (reference, reference_val) = read_steps(out_dir), read_steps(reference_dir)
    steps = list(steps or reference)

    def differences(metric):
        return largest(difference(train[s][metric], reference[s][metric])
                       if s in train and train[s]["bucket_len"] == reference[s]["bucket_len"] else math.inf
                       for s in steps)

    return {"max |loss - ref|": differences("loss"), "max |grad norm - ref|": differences("grad_norm"),
            "max |val loss - ref|": largest(difference(val[s], reference_val[s]) if s in val else math.inf
                                            for s in reference_val if s <= max(steps)),
            "val loss": val[max(val)] if val else None, "buckets": len({row["bucket_len"] for row in train.values()}),
            "ref buckets": len({reference[s]["bucket_len"] for s in steps})}


def failed_checks(row, warmup_steps, tolerance, flag="--tolerance"):
    """What fails a compared row: a difference over the tolerance or not a number (a step in another bucket than
    the reference's counts as infinite), a reference that trained fewer than BUCKETS' buckets, or no step past the
    warmup (where the learning rate is small, so is any difference)."""
    failed = [f"{column} is {row[column]:.1e}" for column in COMPARED if not row[column] <= tolerance]  # NaN too
    failed = [f"{', '.join(failed)}, over {flag} {tolerance:g}"] if failed else []
    if row["ref buckets"] < len(BUCKETS.split(",")) or row["steps"] <= warmup_steps:
        failed.append(f"{row['steps']} steps train {row['ref buckets']} of the {len(BUCKETS.split(','))} buckets, "
                      f"the warmup {warmup_steps}: raise --steps")
    return failed


def table(rows):
    """The printed table: a line per row."""
    lines = [f"{'row':<18} {'world':>5} " + " ".join(f"{column:>22}" for column in COLUMNS)]
    for row in rows:
        cells = [f"{row[column]:>22.2e}" if column.startswith("max") and row.get(column) is not None else
                 f"{row[column]:>22.4f}" if column == "val loss" and row.get(column) is not None else
                 f"{row[column]:>22}" if column == "buckets" and row.get(column) is not None else
                 f"{row[column]:>22.0f}" if column == "seconds" else f"{'failed':>22}" for column in COLUMNS]
        lines.append(f"{row['row']:<18} {row['world']:>5} " + " ".join(cells))
    return "\n".join(lines)


def draw(rows, out_dir, path):
    """The loss curves of each reference and every row, one colour per row; beside them each row's |loss - ref| per
    step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, gaps) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = set()
    for i, row in enumerate(r for r in rows if r.get("val loss") is not None):
        steps, _ = read_steps(out_dir / row["folder"])
        reference, _ = read_steps(out_dir / row["reference"])
        label, colour = f"{row['row']}, world {row['world']}", colours[i % len(colours)]
        if row["reference"] not in drawn:
            curves.plot(list(reference), [r["loss"] for r in reference.values()], color="black", linewidth=3,
                        alpha=0.3, label=f"{row['reference'].split('-')[0]}, {row['reference'].split('-')[1]} "
                        f"batches a step")
            drawn.add(row["reference"])
        curves.plot(list(steps), [r["loss"] for r in steps.values()], color=colour, linewidth=1, label=label)
        gap = [max(difference(steps[s]["loss"], reference[s]["loss"]), 1e-12) for s in steps if s in reference]
        gaps.plot([s for s in steps if s in reference], gap, color=colour, marker=".", label=label)
    curves.set(xlabel="step", ylabel="training loss", title="loss: every row over its reference")
    gaps.set(xlabel="step", ylabel="|loss - ref| (floored at 1e-12)", yscale="log", title="difference from the ref")
    gaps.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main():
    args = parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, failures = [], []
    for name, script, flags, divisor, world in planned_rows(args):
        folder = f"{name.replace(' ', '-')}-world-{world}"
        accum = ["--grad-accum", str(divisor)] if divisor > 1 else []
        steps = math.ceil(args.steps * 2 / world)  # world batches a step: the samples of --steps at world 2
        seconds, status, error, reused = run(script, [*flags, *accum], world, steps, out_dir / folder, args)
        row = {"row": name, "world": world, "script": script, "flags": [*flags, *accum], "steps": steps,
               "folder": folder, "seconds": seconds, "reused": reused}
        results.append(row)
        print(f"{name}, world {world}: {'reused, ' if reused else ''}{seconds:.0f} s", file=sys.stderr)
        if status:
            failures.append(f"{name} at world {world}: the run failed (exit {status}): {error}")
            continue
        # DDP's reference takes the row's global batch (its config.json), on 2 processes (world 1: 1): made once; an
        # AGAINST_ITSELF row's, its own script on one process, the step's batches as micro-batches or as one batch.
        config, ranks = json.loads((out_dir / folder / "config.json").read_text()), min(2, world)
        batches = config["tokens_per_step"] // config["flags"]["tokens_per_batch"]
        itself = AGAINST_ITSELF.get(name) or (args.against_itself if args.scripts else None)
        reference, ranks = (script, 1) if itself else ("ddp_pretrain.py", ranks)
        row["reference"] = f"{Path(reference).stem}-{batches}-batches-{steps}-steps"
        if batches % ranks:
            failures.append(f"{name} at world {world}: {batches} batches a step, which DDP on 2 processes cannot take")
            continue
        model = flags[flags.index("--model"):][:2] if itself and "--model" in flags else []  # the row's preset
        batch = (["--tokens-per-batch", str(config["tokens_per_step"])] if itself == "one-batch" else
                 ["--grad-accum", str(batches // ranks)])
        if itself == "one-batch":
            row["reference"] = row["reference"].replace("-batches-", "-batches-as-one-")
        _, status, error, _ = run(reference, [*model, *batch], ranks, steps, out_dir / row["reference"], args)
        if status:
            raise common.ReportedError(f"{reference}'s reference of {batches} batches a step failed (exit {status}): "
                                       f"{error}")
        row.update(compare(out_dir / folder, out_dir / row["reference"]))
        tolerance = ((args.one_batch_tolerance, "--one-batch-tolerance") if itself == "one-batch" else
                     (args.tolerance, "--tolerance"))
        row["tolerance"] = tolerance[0]
        failures += [f"{name} at world {world}: {failure}" for failure in
                     failed_checks(row, config["flags"]["warmup_steps"], *tolerance)]
    print(table(results))
    (out_dir / "parity.json").write_text(json.dumps({"tolerance": args.tolerance, "steps": args.steps,
                                                     "one_batch_tolerance": args.one_batch_tolerance,
                                                     "dtype": args.dtype, "device": args.device, "rows": results},
                                                    indent=1))
    draw(results, out_dir, out_dir / "parity.png")
    print(f"parity.json and parity.png in {out_dir}")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
