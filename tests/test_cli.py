"""What a user sees before and as a run starts: --help with each flag's effective default for the --model given, one
error line for a flag out of its range or not honoured, --max-tokens, the start block and config.json, the progress
bar."""
import contextlib
import io
import json
import re
import runpy
import sys

import pytest

import common
import loading
from helpers import REPO, check, run_script

STAGES = {"ddp_pretrain.py": "train", "fsdp1_pretrain.py": "train", "fsdp2_pretrain.py": "train",
          "fsdp2_tp_pretrain.py": "train", "fsdp2_cp_pretrain.py": "train", "fsdp2_3d_pretrain.py": "train",
          "pp_pretrain.py": "train", "fsdp2_muon_pretrain.py": "train", "fsdp2_sft.py": "sft", "fsdp2_grpo.py": "grpo"}
PRESETS = {STAGES[script]: loading.script_presets(script) for script in STAGES}  # each kind of script's


def parse(stage, flags):
    """The flags as a script of this stage parses them (its own flags aside)."""
    parser = common.get_parser("", "runs/x")
    if stage != "grpo":  # its steps take prompts, not batches of samples
        common.add_batch_arguments(parser)
    return common.parse_args(parser, PRESETS[stage], flags)


def help_text(script, *flags):
    """What `python SCRIPT [FLAGS] --help` prints: the script's own code, run in this process up to argparse's exit
    (its imports are made already; test_bad_input.py's COMMAND_LINE cases run the scripts as a user does)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", "120")  # wrapped alike on any terminal
        patch.setattr(sys, "argv", [script, *flags, "--help"])
        with contextlib.redirect_stdout(io.StringIO()) as stdout, pytest.raises(SystemExit) as exit:
            runpy.run_path(str(REPO / script), run_name="__main__")
    assert exit.value.code == 0
    return stdout.getvalue()


@pytest.fixture(scope="module")
def help_texts():
    """{script: what `python SCRIPT --help` prints}."""
    return {script: help_text(script) for script in STAGES}


def flag_blocks(text):
    """{flag: its help text, wrapped lines joined} from argparse's output."""
    blocks, flag = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            blocks[flag] = line
        elif flag:
            blocks[flag] += " " + line.strip()
    return {flag: " ".join(block.split()) for flag, block in blocks.items() if flag != "-h"}


@pytest.mark.parametrize("script", STAGES)
def test_help_shows_every_flags_default_and_keeps_the_commands_lines(script, help_texts):
    text = help_texts[script]
    blocks = flag_blocks(text)
    assert len(blocks) >= 28
    for flag, block in blocks.items():
        assert "default" in block, f"{script} {flag}: {block}"
        assert "default: None" not in block, f"{script} {flag}: {block}"
    # A flag the preset fills shows the value of the --model given (default: small), as the script's PRESETS say.
    presets = PRESETS[STAGES[script]]
    assert f"(default: {presets['small']['max_steps']})" in blocks["--max-steps"]
    assert f"(default: {presets['small']['buckets']})" in blocks["--buckets"]
    tiny = flag_blocks(help_text(script, "--model", "tiny"))
    assert f"(default: {presets['tiny']['max_steps']})" in tiny["--max-steps"]
    assert presets["tiny"]["max_steps"] != presets["small"]["max_steps"]
    assert "{tiny,small,qwen2-0.5b}" in blocks["--model"]
    # the docstring's command, on its own line
    assert f"\n    torchrun --standalone --nproc_per_node=2 {script}" in text
    if script.startswith("fsdp2"):  # the flags a script adds itself show their defaults too
        assert "(default: True)" in blocks["--reshard-after-forward"]
    if script == "fsdp2_tp_pretrain.py":
        assert "(default: 2)" in blocks["--tp"]
    if script == "fsdp2_cp_pretrain.py":
        assert "(default: 2)" in blocks["--cp"]
    if script == "fsdp2_3d_pretrain.py":  # every degree 1: FSDP2 on any world size
        assert all("(default: 1)" in blocks[flag] for flag in ("--dp-replicate", "--cp", "--tp"))
    if script == "pp_pretrain.py":  # a pipeline wants micro-batches: the script's own default
        assert "(default: the world size)" in blocks["--pp"] and "(default: 4)" in blocks["--grad-accum"]
        assert "(default: 1f1b)" in blocks["--pp-schedule"]


def test_grpo_accepts_no_flag_it_does_not_honour(capsys, help_texts):
    text = help_texts["fsdp2_grpo.py"]
    assert "--grad-accum" not in text and "--bucket-order" not in text
    for flag in (["--grad-accum", "2"], ["--bucket-order", "ascending"]):
        with pytest.raises(common.UsageError) as error:  # the parser fsdp2_grpo.py builds its own flags on
            common.parse_args(common.get_parser("", "runs/x"), PRESETS["grpo"], flag)
        assert str(error.value) == f"unrecognized arguments: {' '.join(flag)}"


@pytest.mark.parametrize("stage,flags,words", [
    ("train", ["--grad-accum", "0"], "argument --grad-accum: must be at least 1, got 0"),
    ("train", ["--val-fraction", "1.5"], "argument --val-fraction: must be at least 0 and at most 1, got 1.5"),
    ("train", ["--lr", "-0.1"], "argument --lr: must be at least 0, got -0.1"),
    ("train", ["--lr", "nan"], "argument --lr: must be at least 0, got nan"),
    ("train", ["--min-lr-ratio", "2"], "argument --min-lr-ratio: must be at least 0 and at most 1, got 2"),
    ("train", ["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    ("train", ["--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
    ("train", ["--buckets", "1,64"], "argument --buckets: every bucket must hold at least 2 tokens"),
])
def test_a_flag_out_of_its_range_is_one_line_naming_it(stage, flags, words):
    with pytest.raises(common.UsageError) as error:  # one line `error: ...`, exit status 2 (test_bad_input.py)
        parse(stage, flags)
    assert str(error.value).startswith(words) and "\n" not in str(error.value), error.value


def test_max_tokens_sets_the_steps_from_the_tokens_per_step(ddp_one_process):
    """Each script counts the positions of its own step (tokens per batch x micro-batches x the ranks that read
    different samples; fsdp2_grpo.py: its rollouts, test_fsdp2_grpo.py) and records them in config.json; --max-tokens
    is that many steps, rounded up."""
    # 1 rank x 2 micro-batches of TINY_RUN's 256 tokens (2 ranks x 1: test_a_run_prints_its_configuration_once_...).
    assert json.loads((ddp_one_process / "config.json").read_text())["tokens_per_step"] == 256 * 2

    def finalize(stage, *flags, tokens_per_step=2048):
        return common.finalize_args(parse(stage, ["--model", "tiny", *flags]), tokens_per_step)

    assert finalize("train", "--max-tokens", "10000").max_steps == 5
    assert finalize("train", "--max-tokens", "10240").max_steps == 5  # exactly 5 steps' worth
    assert finalize("grpo", "--max-tokens", "4000", tokens_per_step=1000).max_steps == 4
    with pytest.raises(common.UsageError, match="not allowed with argument"):  # the length in steps or in tokens
        finalize("train", "--max-tokens", "1000", "--max-steps", "5")


def test_generate_refuses_a_negative_temperature_in_one_line(tmp_path):
    result = run_script("generate.py", tmp_path, "--prompt", "Hi", "--temperature", "-1", torchrun=False)
    assert result.returncode == 2 and result.stderr == "error: argument --temperature: must be at least 0, got -1\n"


def test_a_run_prints_its_configuration_once_and_writes_config_json(tiny_run):
    out, result = tiny_run("ddp_pretrain.py")
    config = json.loads((out / "config.json").read_text())
    n_params = 3_342_912  # the tiny preset
    assert config["script"] == "ddp_pretrain" and config["world_size"] == 2 and config["parameters"] == n_params
    assert config["device"] == "cpu" and config["dtype"] == "float32"
    assert config["tokens_per_step"] == 256 * 2 and config["total_tokens"] == 20 * 512  # 2 ranks, 20 steps
    assert config["training_flops"] == 6 * n_params * 20 * 512
    assert config["flags"]["max_steps"] == 20 and config["flags"]["buckets"] == [32, 48, 64, 96, 128]
    assert config["flags"]["out_dir"] == str(out) and "stage" not in config["flags"]
    assert config["started_from"] is None and "parameters, from its own initialization" in result.stdout
    assert result.stdout.count("tokens per step") == 1  # rank 0 alone
    assert "512 tokens per step x 20 steps = 10,240 tokens" in result.stdout
    for name, value in config["flags"].items():  # every flag in the block
        shown = ",".join(map(str, value)) if isinstance(value, list) else value
        assert f"--{name.replace('_', '-')}={shown}" in result.stdout, name


def test_the_progress_bar_shows_loss_speed_and_peak_memory(tiny_run):
    _, result = tiny_run("ddp_pretrain.py")
    # CPUs have no known peak FLOP/s, so no MFU there; on a listed GPU "mfu=" comes before "mem=".
    assert re.search(r"loss=\d+\.\d{3}, tok/s=[\d,]+, mem=\d+\.\d\dGB, bucket=\d+", result.stderr), \
        result.stderr[-2000:]


def test_prepare_data_help_keeps_its_commands_lines():
    result = check(run_script("prepare_data.py", "--help", torchrun=False))
    # the docstring kept its lines
    assert "\n    python prepare_data.py --data HuggingFaceFW/fineweb-edu" in result.stdout
    assert "--workers" in result.stdout and "(default:" in result.stdout
