"""pipeline.py end to end on the tiny preset: every stage in order, each from the one before, the control for GRPO's
time from the SFT's last weights, then every stage on one scale in eval.jsonl and report.md; and its bad input."""
import datetime
import importlib.metadata
import json
import shlex
import shutil
import subprocess

import pytest

import pipeline
import tasks as builtin_tasks
from helpers import BUILTIN_RL, BUILTIN_SFT, REPO, TINY_DATA, check, read_metrics, run_script


def test_the_pipeline_runs_its_stages_from_the_one_before_and_reports_them(tiny_run, tmp_path):
    """The shared tiny runs stand in for the pretrain and sft stages (the same code launches every stage); midtraining
    runs here from the pretrain stage, GRPO and the control from the sft stage."""
    out = tmp_path / "pipeline"
    for stage, script in [("pretrain", "fsdp2_pretrain.py"), ("sft", "fsdp2_sft.py")]:
        shutil.copytree(tiny_run(script)[0], out / stage)
    flags = ["--model", "tiny", "--nproc", 1, "--seed", 3, "--out-dir", out, "--stages",
             "mid,grpo,control,reference,eval",
             "--pretrain-data", TINY_DATA, "--mid-data", BUILTIN_SFT, "--sft-data", BUILTIN_SFT, "--rl-data",
             BUILTIN_RL, "--dtype", "fp32",
             "--max-steps", 2, "--eval-every", 2, "--save-every", 2, "--val-fraction", 0.002, "--eval-limit", 2]
    started = datetime.date.today()
    check(run_script("pipeline.py", *flags))
    configs = {stage: json.loads((out / stage / "config.json").read_text())["flags"] for stage in pipeline.SCRIPTS}
    assert all(configs[stage]["seed"] == 3 and configs[stage]["model"] == "tiny" for stage in ("grpo", "control"))
    assert configs["grpo"]["init_from"] == configs["control"]["init_from"] == str(out / "sft")
    # Midtraining: pretraining from the pretrain stage's weights, on its text and the built-in conversations 70:30.
    assert configs["mid"]["init_from"] == str(out / "pretrain") and configs["mid"]["lr_schedule"] == "wsd"
    assert configs["mid"]["data"] == [f"{TINY_DATA}:0.7", f"{BUILTIN_SFT}:0.3"]
    # The reference: the SFT from midtraining's weights, on the built-in set with every solve row worked.
    assert configs["reference"]["init_from"] == str(out / "mid")
    reference_rows = [json.loads(line) for line in (out / "reference.jsonl").read_text().splitlines()]
    assert configs["reference"]["data"] == str(out / "reference-data")
    assert len(reference_rows) == len(builtin_tasks.builtin_sft_records())
    assert all("First, " in row["conversations"][1]["value"] for row in reference_rows)
    # The control: as many steps as GRPO's time holds at the SFT's pace, at the SFT's final rate, held.
    sft_rows = list(read_metrics(out / "sft")[0].values())
    grpo_time = max(row["elapsed_s"] for row in read_metrics(out / "grpo")[0].values())
    seconds_per_step = sft_rows[-1]["elapsed_s"] / sft_rows[-1]["step"]
    assert configs["control"]["max_steps"] == max(1, round(grpo_time / seconds_per_step))
    assert configs["control"]["lr"] == configs["sft"]["lr"] * configs["sft"]["min_lr_ratio"]
    assert configs["control"]["min_lr_ratio"] == 1 and configs["control"]["warmup_steps"] == 0
    # It starts from the SFT's last weights as they are (its markers kept): the same validation loss at its step 0.
    sft_end = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()][-1]
    control_start = json.loads((out / "control" / "metrics.jsonl").read_text().splitlines()[0])
    # (1 process here, 2 there: the same sum in another order)
    assert control_start["step"] == 0 and control_start["val_loss"] == pytest.approx(sft_end["val_loss"], rel=1e-6)

    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    tasks = {stage: {row["task"] for row in rows if row["stage"] == stage} for stage in pipeline.SCRIPTS}
    assert tasks["pretrain"] == {"prose_bpb", "arith_choice"}
    assert all(tasks[stage] >= set(pipeline.COMPARED) for stage in ("sft", "grpo", "control", "reference"))
    sampled = {(row["stage"], row["task"]) for row in rows if row["metric"] == "pass@8"}
    assert sampled == {(stage, task) for stage in ("sft", "grpo") for task in pipeline.SAMPLED}
    assert all(row["ci_low"] <= row["value"] <= row["ci_high"] and row["step"] for row in rows)
    assert {row["n"] for row in rows if row["task"] != "prose_bpb" and row["metric"] != "sampled_worked"} == {2}
    assert {row["n"] for row in rows if row["metric"] == "sampled_worked"} == {2 * 8}  # --eval-limit reached it
    report = (out / "report.md").read_text()
    assert "| task: metric | pretrain | mid | sft | grpo | control | reference |" in report and "GRPO - SFT" in report
    assert "| `solve`: pass@8 |" in report
    # Every checkpoint evaluated, at the tokens of all stages so far: each run's own, after its source's.
    assert sum(row["newest"] for row in rows if row["task"] == "prose_bpb" and row["stage"] == "pretrain") == 1
    assert len({row["step"] for row in rows if row["stage"] == "pretrain"}) == 2  # steps 10 and 20
    assert (min(row["tokens"] for row in rows if row["stage"] == "mid")
            > max(row["tokens"] for row in rows if row["stage"] == "pretrain"))
    assert (out / "abilities.png").stat().st_size > 0
    # How it was made: this very command (every flag), the commit, the date, torch; each stage's own command.
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    header = f"Written by `{shlex.join(['python', 'pipeline.py', *map(str, flags)])}` at commit {commit.stdout.strip()}"
    dates = {started.isoformat(), datetime.date.today().isoformat()}  # a run may cross midnight
    assert header in report and any(date in report for date in dates)
    assert f"torch {importlib.metadata.version('torch')}" in report
    runs = json.loads((out / "stages.json").read_text())
    assert sorted(runs) == ["control", "grpo", "mid", "reference"]
    assert all(f"`{run['command']}`" in report for run in runs.values())
    assert runs["grpo"]["command"].startswith("torchrun --standalone --nproc_per_node=1 fsdp2_grpo.py --model tiny")
    assert "--dtype fp32" in runs["grpo"]["command"] and "--init-from" in runs["control"]["command"]
    grpo = next(row for row in rows if (row["stage"], row["task"], row["metric"]) == ("grpo", "arith_gen", "accuracy"))
    assert pipeline.cell(grpo) in report
    assert all((out / f"{name}.png").stat().st_size > 0 for name in ("pretrain", "sft", "grpo"))


def test_bad_input_is_one_line_before_any_stage_runs(tmp_path):
    result = run_script("pipeline.py", "--stages", "pretrain,rlhf", "--out-dir", tmp_path / "run")
    assert result.returncode == 2 and result.stderr.startswith("error: argument --stages: unknown stage rlhf")
    result = run_script("pipeline.py", "--stages", "control", "--out-dir", tmp_path / "run", "--sft-data", BUILTIN_SFT,
                        "--pretrain-data", TINY_DATA, "--mid-data", BUILTIN_SFT, "--rl-data", BUILTIN_RL)  # prepared
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "run its stage first (--stages)" in lines[0], result.stderr
    assert not (tmp_path / "run" / "control").exists()
