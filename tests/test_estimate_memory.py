"""estimate_memory.py and the scripts' --estimate-memory: the fake run's parameter, gradient and optimizer bytes per
rank are the real tensors' bytes, its peak is a real run's under the same tracker, and the strategies' trends hold."""
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import BUILTIN_SFT, PYTHON, REPO, TINY_DATA, check, run_script

# One step per bucket of the tiny model, fp32; two micro-batches, so that the gradients of the first meet the second.
FLAGS = ["--model", "tiny", "--data", TINY_DATA, "--buckets", "64", "--tokens-per-batch", 128, "--grad-accum", 2,
         "--dtype", "fp32"]
PARAMETERS = ["Parameter", "Sharded Param"]
GRADIENTS = ["Gradient", "Sharded Grad", "Unsharded Grad"]
OPTIMIZER = ["Optstate", "OptState"]
# CP's runs: a sequence long enough that its activations, not the weights' gradients, make the peak; the loss in one
# chunk, so that its logits are a rank's rows.
LONG = ["--buckets", 2048, "--tokens-per-batch", 2048, "--loss-chunk-rows", 4096]


def estimate(out_dir, script, *flags, world_size=2, mode="fake"):
    """The bucket's categories (bytes) from SCRIPT --estimate-memory MODE: fake, one process standing for rank 0 of
    WORLD_SIZE; real, WORLD_SIZE ranks on gloo."""
    if (out_dir / "memory.json").exists():  # the same run, asked for by two tests
        return json.loads((out_dir / "memory.json").read_text())["buckets"][0]["categories"]
    model = ["tiny-moe" if flag == "tiny" else flag for flag in FLAGS] if script == "fsdp2_ep_pretrain.py" else FLAGS
    args = [*model, *flags, "--estimate-memory", mode, "--out-dir", out_dir]
    if mode == "fake":
        check(run_script(script, *args, env={"WORLD_SIZE": str(world_size), "RANK": "0"}))
    else:
        check(run_script(script, *args, nproc=world_size))
    return json.loads((out_dir / "memory.json").read_text())["buckets"][0]["categories"]


def total(categories, names):
    return sum(categories.get(name, 0) for name in names)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    return tmp_path_factory.mktemp("estimates")


@pytest.fixture(scope="module")
def fake_runs(shared_runs):
    """The trends' fake runs, two at a time: {name: categories}."""
    runs = {"fsdp2 world 2": ("fsdp2_pretrain.py", [], 2), "fsdp2 world 4": ("fsdp2_pretrain.py", [], 4),
            "fsdp2 selective": ("fsdp2_pretrain.py", ["--activation-checkpointing", "selective"], 2),
            "fsdp2 none": ("fsdp2_pretrain.py", ["--activation-checkpointing", "none"], 2),
            "cp 2": ("fsdp2_cp_pretrain.py", ["--cp", 2, *LONG], 4),
            "cp 4": ("fsdp2_cp_pretrain.py", ["--cp", 4, *LONG], 4),
            "replicate 2 x cp 2": ("fsdp2_3d_pretrain.py", ["--dp-replicate", 2, "--cp", 2, *LONG], 4),
            "ep 2 of 4": ("fsdp2_ep_pretrain.py", ["--ep", 2], 4),
            "ep 4 of 4": ("fsdp2_ep_pretrain.py", ["--ep", 4], 4),
            "lora rank 4": ("fsdp2_lora_sft.py", ["--data", BUILTIN_SFT, "--lora-rank", 4], 2)}
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(estimate, shared_runs / name.replace(" ", "-"), script, *flags,
                                     world_size=world_size) for name, (script, flags, world_size) in runs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("script", ["fsdp2_pretrain.py", "ddp_pretrain.py"])
@pytest.mark.slow  # multi-process runs of its own
def test_the_fake_run_counts_what_a_real_run_holds(script, shared_runs, tmp_path):
    """At world 2, the fake run's parameters, gradients and optimizer state per rank are the real tensors' bytes,
    exactly (FSDP2: each parameter's shard, its dim 0 padded to a multiple of 2), and its peak is the real run's under
    the same tracker: FSDP2's activations exactly, DDP's within 1% (its buckets counted apart)."""
    import modeling

    fake = estimate(shared_runs / ("fsdp2-world-2" if script == "fsdp2_pretrain.py" else "ddp"), script)
    real = estimate(tmp_path / "real", script, mode="real")
    shapes = [p.shape for p in modeling.build_model("tiny").parameters()]  # the tied embedding once
    if script == "fsdp2_pretrain.py":
        shard_bytes = sum(math.ceil(shape[0] / 2) * math.prod(shape[1:]) * 4 for shape in shapes)
    else:
        shard_bytes = sum(math.prod(shape) * 4 for shape in shapes)
    for categories in (fake, real):
        assert total(categories, PARAMETERS) == shard_bytes
        assert total(categories, OPTIMIZER) == 2 * shard_bytes + 4 * len(shapes)  # AdamW's moments and step counts
    assert total(fake, GRADIENTS) == total(real, GRADIENTS)
    if script == "fsdp2_pretrain.py":
        assert fake["Activation"] == pytest.approx(real["Activation"], rel=0.05)
        assert fake["Total"] == real["Total"]
    else:
        # One more copy of the gradients, in fp32: DDP's C++ reducer allocates it outside fake tensors, and a real run's
        # tracker sees it only from its first write, so the peaks compare without it.
        assert fake["DDP buckets"] == shard_bytes
        assert fake["Total"] - fake["DDP buckets"] == pytest.approx(real["Total"], rel=0.01)


def test_the_trends_hold(fake_runs):
    """FSDP2's state per rank falls as 1 / world size; CP's activations fall with cp (from cp 2 to 4 by over a third:
    all but the loss's weight gradient halves); full checkpointing keeps fewer activations than selective, and
    selective fewer than none. The 3D script at replicate 2 x cp 2 on 4 ranks holds FSDP2's state of 2 ranks (shards
    over the cp pair, a copy in the other replica) and CP's activations at cp 2. The MoE script holds a quarter of its
    model on each of 4 ranks at ep 2 as at ep 4. LoRA's gradients and AdamW's state are its adapters' alone."""
    def state(name):
        return total(fake_runs[name], PARAMETERS + OPTIMIZER)

    assert state("fsdp2 world 4") == pytest.approx(state("fsdp2 world 2") / 2, rel=0.01)
    assert fake_runs["cp 4"]["Activation"] < 0.65 * fake_runs["cp 2"]["Activation"]
    assert fake_runs["fsdp2 world 2"]["Activation"] < fake_runs["fsdp2 selective"]["Activation"]
    assert fake_runs["fsdp2 selective"]["Activation"] < fake_runs["fsdp2 none"]["Activation"]
    assert state("replicate 2 x cp 2") == state("fsdp2 world 2")
    # The MoE script: each rank holds a quarter of every expert's elements at ep 2 (4 experts, half of each) as at ep 4
    # (2 experts whole), and of the rest; a quarter of the model's parameters in all, AdamW's two moments beside them.
    moe_bytes = 3_565_248 * 4  # tiny-moe's parameters, fp32
    for name in ("ep 2 of 4", "ep 4 of 4"):
        assert total(fake_runs[name], PARAMETERS) == pytest.approx(moe_bytes / 4, rel=1e-3)
        assert total(fake_runs[name], OPTIMIZER) == pytest.approx(2 * moe_bytes / 4, rel=1e-3)
    assert fake_runs["replicate 2 x cp 2"]["Activation"] == fake_runs["cp 2"]["Activation"]
    # LoRA: the base's shards as FSDP2's, the adapters' beside them (A: r x in, B: out x r, each halved at world 2) and
    # the 8 marker rows' delta (8 x hidden, halved); gradients and AdamW's moments (and step counts) for those only.
    import modeling

    model = modeling.build_model("tiny")
    targets = [m for name, m in model.named_modules() if name.endswith("_proj")]
    adapter_bytes = (sum(4 * (m.in_features + m.out_features) for m in targets) + 8 * model.config.hidden_size) * 4 // 2
    lora = fake_runs["lora rank 4"]
    assert total(lora, PARAMETERS) == total(fake_runs["fsdp2 world 2"], PARAMETERS) + adapter_bytes
    assert total(lora, OPTIMIZER) == 2 * adapter_bytes + 4 * (2 * len(targets) + 1)
    assert 0 < total(lora, GRADIENTS) <= 2 * adapter_bytes


def test_the_tool_prints_a_table_per_strategy_and_why_pp_has_none(tmp_path):
    """Its own flags reach the rows: fsdp2-3d at --dp-replicate 2 on 2 GPUs holds the whole model, FSDP2 half."""
    import subprocess

    out = tmp_path / "out"
    done = check(subprocess.run([PYTHON, REPO / "estimate_memory.py", "--model", "tiny", "--gpus", "2", "--buckets",
                                 "64", "--strategies", "fsdp2", "fsdp2-3d", "pp", "--dp-replicate", "2", "--cp", "1",
                                 "--tp", "1", "--gpu-memory", "1", "--out", out, "--activation-checkpointing",
                                 "selective", "--data", TINY_DATA], cwd=REPO, capture_output=True, text=True,
                                timeout=300))
    report = json.loads((out / "memory.json").read_text())
    held = {strategy: total(report["estimates"][strategy]["buckets"][0]["categories"], PARAMETERS)
            for strategy in ("fsdp2", "fsdp2-3d")}
    assert held["fsdp2-3d"] == 2 * held["fsdp2"]
    assert (out / "memory.png").stat().st_size > 0
    assert [bucket["bucket_len"] for bucket in report["estimates"]["fsdp2"]["buckets"]] == [64]
    assert report["passed_on"][:2] == ["--activation-checkpointing", "selective"]
    assert "pipeline stages exchange their tensors' shapes" in report["estimates"]["pp"]["error"]
    lines = done.stdout.splitlines()
    fsdp2 = lines.index(next(line for line in lines if line.startswith("fsdp2:")))
    assert lines[fsdp2 + 1].split() == ["bucket", "parameters", "gradients", "optimizer", "activations",
                                        "temporaries", "total", "fits"]
    row = lines[fsdp2 + 2].split()
    assert row[0] == "64" and row[-1] == "yes"  # 1 GiB: the tiny model fits
    assert any("not measured: error: --estimate-memory: pipeline stages" in line for line in lines)


@pytest.mark.parametrize("flags,named", [(["--check-on-gpu"], "--gpus 1"),
                                         (["--check-on-gpu", "--gpus", "1"], "drop --check-on-gpu"),
                                         (["--out-dir", "elsewhere"], "--out instead")])
def test_a_check_that_cannot_run_is_one_line(flags, named):
    import subprocess

    done = subprocess.run([PYTHON, REPO / "estimate_memory.py", *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and named in done.stderr, done.stderr
