"""fsdp2_cp_pretrain.py on CPU with gloo: context parallelism x FSDP2 trains as DDP does, its attention over a
sequence split in zigzag pieces equals one process's in output and gradients, bad --cp and --buckets are one line, and
its checkpoints continue in fsdp2_pretrain.py and back at another world size. Its lines with more than one replica
(dp 2 x cp 2, and x tp 2) run in fsdp2_3d_pretrain.py's 8-process test."""
import json
import os

import pytest

from helpers import (
    TINY_RUN,
    assert_same_steps,
    check,
    copy_checkpoint,
    read_metrics,
    run_script,
    run_until_the_first_collective,
    traceback_through_our_code,
)


def test_the_attention_equals_one_process_sdpa_in_output_and_gradients(tiny_run):
    """Inside the 2-rank run (tests/cp_probe.py): random queries, keys and values of 32 positions, each rank its zigzag
    piece; its output and the gradients of its queries, keys and values are the whole sequence's, piece by piece."""
    probe = json.loads((tiny_run("fsdp2_cp_pretrain.py")[0].parent / "probe.json").read_text())
    length, ranks = probe["sequence"], probe["ranks"]
    assert length == 32 and len(ranks) == 2
    # 4 chunks of 8: rank 0 holds the first and the last, rank 1 the two middle ones.
    assert ranks[0]["positions"] == [*range(0, 8), *range(24, 32)]
    assert ranks[1]["positions"] == list(range(8, 24))
    # The same share of the causal triangle: a query at position p attends to p + 1 keys.
    assert [sum(p + 1 for p in rank["positions"]) for rank in ranks] == [264, 264]
    for rank in ranks:
        assert rank["output_shape"] == [2, 16, 4, 16] and rank["weights"] is None  # [batch, positions, heads, dim]
        assert rank["differences"].keys() == {"output", "grad_query", "grad_key", "grad_value"}
        assert max(rank["differences"].values()) < 1e-5, rank["differences"]


BAD_CP = {  # case: (flags, world size, words the error line must hold: the flag first)
    "--cp that does not divide the world size": (["--cp", 3], 4, ["--cp 3", "world size 4"]),
    "a bucket that 2 x cp does not divide": (["--cp", 2, "--buckets", "30,64"], 4, ["--buckets 30,64", "= 4"]),
    "--cp beyond what the buckets allow": (["--cp", 32, "--buckets", "32,64"], 64, ["--buckets 32,64", "= 64"]),
    "--compile": (["--cp", 1, "--compile"], 1, ["--compile", "eager"]),
}


@pytest.mark.parametrize("case", BAD_CP)
def test_bad_cp_input_gives_one_clear_line_before_any_collective(case, tmp_path, monkeypatch):
    flags, world_size, words = BAD_CP[case]
    flags = ["--model", "tiny", *map(str, flags), "--out-dir", str(tmp_path / "run")]
    code, stderr = run_until_the_first_collective("fsdp2_cp_pretrain.py", flags, world_size, monkeypatch)
    lines = stderr.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words)


@pytest.mark.slow  # multi-process runs of its own
def test_on_2_ranks_a_bad_bucket_is_one_line_from_one_rank(tmp_path):
    """Even when rank 1 gets there first: rank 0 starts 3 s late (a sitecustomize, which Python imports at start-up),
    and torchrun would stop it the moment rank 1 exited."""
    (tmp_path / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '0': time.sleep(3)\n")
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = run_script("fsdp2_cp_pretrain.py", "--model", "tiny", "--buckets", "30,64", "--out-dir", tmp_path / "run",
                        nproc=2, torchrun=True, env={"PYTHONPATH": python_path})
    assert result.returncode == 1 and "exitcode  : 2 " in result.stderr  # torchrun names its ranks' statuses
    assert not traceback_through_our_code(result.stdout + result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --buckets 30,64: every bucket length must be a multiple of 2 x --cp = 4: change "
                      "--buckets or --cp"]


def test_a_cp_checkpoint_continues_in_fsdp2_pretrain_and_back(tiny_run, tmp_path):
    """dp 1 x cp 2 on 2 ranks, to fsdp2_pretrain.py on 1 process at step 10, back to dp 1 x cp 2 on 2 ranks at step 15:
    DCP reshards each time; the global batch is the same, so are the steps of the uninterrupted run."""
    cp_run = tiny_run("fsdp2_cp_pretrain.py")[0]
    fsdp2 = copy_checkpoint(cp_run, 10, tmp_path / "fsdp2")
    result = check(run_script("fsdp2_pretrain.py", *TINY_RUN, "--grad-accum", 2, "--save-every", 5, "--out-dir", fsdp2,
                              "--resume"))
    assert "at step 10" in result.stdout and sorted(read_metrics(fsdp2)[0]) == list(range(11, 21))
    assert_same_steps(fsdp2, cp_run, range(11, 21), 1e-5, 1e-5)
    back = copy_checkpoint(fsdp2, 15, tmp_path / "cp")
    result = check(run_script("fsdp2_cp_pretrain.py", *TINY_RUN, "--grad-accum", 2, "--out-dir", back, "--resume",
                              nproc=2))
    assert "at step 15" in result.stdout and sorted(read_metrics(back)[0]) == list(range(16, 21))
    assert_same_steps(back, cp_run, range(16, 21), 1e-5, 1e-5)
