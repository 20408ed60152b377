"""Every user mistake we could think of ends the run with one `error:` line that names the flag to change, before the
run's first collective, with a non-zero exit, no traceback from our code, and every existing checkpoint byte-for-byte
as it was. docs/errors.md lists the same table.

Each case runs the script's own code in this process, up to its first collective (common.init_process_group, which
here stops the run instead): the imports are already made, so a case takes a fraction of a second instead of a
process start. A few cases (COMMAND_LINE) also run as a user runs them, to see the one line a terminal shows."""
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

import checkpoints
import common
import data
import prepare_data
from helpers import (
    BUILTIN_RL,
    BUILTIN_SFT,
    RL_DATA,
    TINY_DATA,
    TINY_RUN,
    copy_checkpoint,
    prepare_folder,
    run_script,
    run_until_the_first_collective,
    traceback_through_our_code,
    tree_hashes,
    tree_stats,
)

SFT_INIT = ["--init-from", "{tmp}/fsdp2"]  # a valid pretrained checkpoint, so the SFT gets as far as its data
BAD_INPUTS = {  # case: (script, flags, ranks, words the error line must hold: the flag first)
    "data path that does not exist":
        ("prepare_data.py", ["--data", "{tmp}/nope/train.txt"], 1, ["--data", "does not exist"]),
    "missing path inside a folder that exists (as README names prepared folders)":
        ("prepare_data.py", ["--data", "docs/nope"], 1, ["--data docs/nope", "does not exist"]),
    "name that is neither a path nor a hub dataset":
        ("prepare_data.py", ["--data", "mydata"], 1, ["--data mydata", "does not exist", "(owner/name)"]),
    "folder with no data files": ("prepare_data.py", ["--data", "{tmp}/empty_folder"], 1, ["--data", "holds no"]),
    "text file that is not UTF-8":
        ("prepare_data.py", ["--data", "{tmp}/latin1.txt"], 1, ["--data", "could not be read"]),
    "data folder mixing file kinds": ("prepare_data.py", ["--data", "{tmp}/mixed"], 1, ["--data", "mixes file types"]),
    "jsonl with a broken line":
        ("prepare_data.py", ["--data", "{tmp}/broken.jsonl"], 1, ["--data", "could not be read"]),
    "only blank documents": ("prepare_data.py", ["--data", "{tmp}/blank.txt"], 1, ["--data", "holds no documents"]),
    "empty data file": ("prepare_data.py", ["--data", "{tmp}/empty.jsonl"], 1, ["--data", "is an empty file"]),
    "SFT file that is not what its suffix says":
        ("prepare_data.py", ["--sft", "--data", "{tmp}/text.parquet"], 1, ["--data", "could not be read"]),
    "no such text column": ("prepare_data.py", ["--data", "{tmp}/content.jsonl"], 1, ["--text-field", "content"]),
    "SFT rows in no schema": ("prepare_data.py", ["--sft", "--data", "{tmp}/input_output.jsonl"], 1,
                              ["--data", "none of"]),
    "SFT turn with an unknown role":
        ("prepare_data.py", ["--sft", "--data", "{tmp}/tool_role.jsonl"], 1, ["--data", "'tool'"]),
    "SFT conversation with no assistant turn":
        ("prepare_data.py", ["--sft", "--data", "{tmp}/no_assistant.jsonl"], 1, ["--data", "no assistant turn"]),
    "problem rows with a prompt and no answer":
        ("prepare_data.py", ["--sft", "--data", "{tmp}/prompt_response.jsonl"], 1, ["--data", "no 'answer'"]),
    "prepared folder over other data":
        ("prepare_data.py", ["--data", "{tmp}/content.jsonl", "--out-dir", "{tmp}/two_docs"], 1,
         ["--out-dir", "holds other data"]),
    "data that is not prepared":
        ("ddp_pretrain.py", ["--model", "tiny", "--data", "{tmp}/two_docs.jsonl"], 1,
         ["--data", "no complete folder written by prepare_data.py", "`python prepare_data.py"]),
    "SFT data that is not prepared":
        ("fsdp2_sft.py", ["--model", "tiny", *SFT_INIT, "--data", "{tmp}/no_assistant.jsonl"], 1,
         ["--data", "prepare_data.py --sft --data SOURCE"]),
    "more ranks than samples":
        ("ddp_pretrain.py", ["--model", "tiny", "--data", "{tmp}/two_docs"], 2, ["--data", "fewer than the 2 ranks"]),
    "mixture weight that is not a number":
        ("ddp_pretrain.py", ["--model", "tiny", "--data", "data/builtin:lots"], 1,
         ["--data data/builtin:lots", "not a number"]),
    "mixture weight of zero":
        ("ddp_pretrain.py", ["--model", "tiny", "--data", "data/builtin:0", "data/builtin-sft:1"], 1,
         ["--data data/builtin:0", "positive"]),
    "mixture weights for some sources only":
        ("ddp_pretrain.py", ["--model", "tiny", "--data", "data/builtin:0.7", "data/builtin-sft"], 1,
         ["--data", "every source a weight"]),
    "mixture source that does not exist":
        ("ddp_pretrain.py", ["--model", "tiny", "--data", f"{TINY_DATA}:0.5", "{tmp}/nope:0.5"], 1,
         ["--data", "nope", "no complete folder"]),
    "SFT given text":
        ("fsdp2_sft.py", ["--model", "tiny", *SFT_INIT, "--data", TINY_DATA], 1, ["--data", "holds text", "--sft"]),
    "SFT replay of conversations":
        ("fsdp2_sft.py", ["--model", "tiny", *SFT_INIT, "--replay", f"{BUILTIN_SFT}:0.2"], 1,
         ["--replay", "pretraining text"]),
    "init-from another strategy's checkpoint":
        ("fsdp2_pretrain.py", ["--model", "tiny", "--init-from", "{tmp}/ddp"], 1,
         ["--init-from", "ddp_pretrain.py", "pass one of fsdp2_pretrain.py"]),
    "init-from another model size":
        ("ddp_pretrain.py", ["--model", "small", "--init-from", "{tmp}/ddp"], 1, ["--init-from", "'tiny'", "--model"]),
    "unknown model preset": ("ddp_pretrain.py", ["--model", "huge"], 1, ["--model", "huge"]),
    "step count that is not a number": ("ddp_pretrain.py", ["--max-steps", "ten"], 1, ["--max-steps", "invalid int"]),
    "buckets that are not numbers":
        ("ddp_pretrain.py", ["--model", "tiny", "--buckets", "short,long"], 1, ["--buckets"]),
    "batch smaller than the largest bucket":
        ("ddp_pretrain.py", ["--model", "tiny", "--tokens-per-batch", 64], 1, ["--tokens-per-batch"]),
    "accumulation below 1":
        ("ddp_pretrain.py", ["--model", "tiny", "--grad-accum", 0], 1, ["--grad-accum", "at least 1"]),
    "out-dir that is a file":
        ("ddp_pretrain.py", ["--model", "tiny", "--out-dir", "{tmp}/blank.txt"], 1, ["--out-dir", "is a file"]),
    "fresh run over existing checkpoints":
        ("ddp_pretrain.py", ["--model", "tiny", "--out-dir", "{tmp}/ddp"], 1, ["--resume", "already holds"]),
    "resume with no checkpoint":
        ("ddp_pretrain.py", ["--model", "tiny", "--resume"], 1, ["--resume", "no complete checkpoint"]),
    "resume from a folder that is no checkpoint":
        ("ddp_pretrain.py", ["--model", "tiny", "--resume", "{tmp}/empty_folder"], 1,
         ["--resume", "not a complete checkpoint"]),
    "resume an older checkpoint beside newer ones":
        ("ddp_pretrain.py", ["--model", "tiny", "--out-dir", "{tmp}/ddp", "--resume", "{tmp}/ddp/checkpoints/step_10"],
         1, ["--resume", "newer checkpoints"]),
    "resume with another model shape":
        ("ddp_pretrain.py", ["--model", "small", "--out-dir", "{tmp}/ddp", "--resume"], 1, ["--model", "'tiny'"]),
    "resume another strategy's checkpoint":
        ("fsdp2_pretrain.py", ["--model", "tiny", "--resume", "{tmp}/ddp/checkpoints/step_20"], 1,
         ["--resume", "ddp_pretrain.py"]),
    "resume auto over another strategy's run":
        ("fsdp2_pretrain.py", ["--model", "tiny", "--out-dir", "{tmp}/ddp", "--resume", "auto"], 1,
         ["--resume", "ddp_pretrain.py, not fsdp2_pretrain.py"]),
    "resume another script's checkpoint of the same layout":
        ("fsdp2_sft.py", ["--model", "tiny", "--resume", "{tmp}/fsdp2/checkpoints/step_20", *SFT_INIT], 1,
         ["--resume", "fsdp2_pretrain.py, not fsdp2_sft.py", "resume it with fsdp2_pretrain.py or"]),
    "resume a run that reached --max-steps":
        ("ddp_pretrain.py", ["--model", "tiny", "--out-dir", "{tmp}/ddp", "--resume"], 1,
         ["--max-steps 20", "step 20 already"]),
    "resume on other data":
        ("ddp_pretrain.py", [*TINY_RUN[:2], "--data", "{tmp}/two_docs", "--out-dir", "{tmp}/ddp10", "--resume"],
         1, ["--data differs", "data order"]),
    "resume with another seed":
        ("ddp_pretrain.py", [*TINY_RUN, "--seed", 7, "--out-dir", "{tmp}/ddp10", "--resume"], 1,
         ["--seed differs", "data order"]),
    "resume with another global batch":
        ("ddp_pretrain.py", [*TINY_RUN, "--tokens-per-batch", 1024, "--out-dir", "{tmp}/ddp10", "--resume"], 1,
         ["--tokens-per-batch 1024", "as it was"]),
    "init-from a DDP checkpoint":
        ("fsdp2_sft.py", ["--model", "tiny", "--init-from", "{tmp}/ddp"], 1, ["--init-from", "ddp_pretrain.py"]),
    "init-from a folder with no checkpoint":
        ("fsdp2_sft.py", ["--model", "tiny", "--init-from", "{tmp}/empty_folder"], 1,
         ["--init-from", "fsdp2_pretrain.py", "first"]),
    "init-from another model shape": ("fsdp2_sft.py", ["--model", "small", *SFT_INIT], 1, ["--model", "'tiny'"]),
    "TP degree that does not divide the KV heads":
        ("fsdp2_tp_pretrain.py", ["--model", "tiny", "--tp", 4], 1, ["--tp 4", "2 KV heads", "'tiny'"]),
    "TP degree that does not divide the world size":
        ("fsdp2_tp_pretrain.py", ["--model", "tiny", "--tp", 2], 1, ["--tp 2", "world size 1"]),
    "compile with tensor parallelism":
        ("fsdp2_tp_pretrain.py", ["--model", "tiny", "--tp", 1, "--compile"], 1, ["--compile", "eager"]),
    "3D degrees whose product does not divide the world size":
        ("fsdp2_3d_pretrain.py", ["--model", "tiny", "--dp-replicate", 2, "--cp", 2, "--tp", 2], 4,
         ["--dp-replicate 2 x --cp 2 x --tp 2", "world size 4"]),
    "3D TP degree beyond the KV heads":
        ("fsdp2_3d_pretrain.py", ["--model", "tiny", "--tp", 4], 4, ["--tp 4", "4 heads and 2 KV heads", "'tiny'"]),
    "3D bucket that 2 x cp does not divide":
        ("fsdp2_3d_pretrain.py", ["--model", "tiny", "--cp", 2, "--buckets", "30,64"], 2, ["--buckets 30,64", "= 4"]),
    "compile with 3D tensor parallelism":
        ("fsdp2_3d_pretrain.py", ["--model", "tiny", "--tp", 2, "--compile"], 2, ["--compile", "--cp 1 --tp 1"]),
    "PP degree that does not divide the layers":
        ("pp_pretrain.py", ["--model", "tiny", "--pp", 4], 1, ["--pp 4", "2 layers", "'tiny'"]),
    "PP degree that does not divide the world size":
        ("pp_pretrain.py", ["--model", "tiny", "--pp", 2], 1, ["--pp 2", "world size 1"]),
    "1F1B with fewer micro-batches than stages":
        ("pp_pretrain.py", ["--model", "tiny", "--pp", 2, "--grad-accum", 1], 2, ["--grad-accum 1", "gpipe"]),
    "a dense preset in the MoE script":
        ("fsdp2_ep_pretrain.py", ["--model", "tiny"], 1, ["--model", "'tiny'", "tiny-moe"]),
    "EP degree that does not divide the world size":
        ("fsdp2_ep_pretrain.py", ["--model", "tiny-moe", "--ep", 4], 2, ["--ep 4", "world size 2"]),
    "EP degree that does not divide the experts":
        ("fsdp2_ep_pretrain.py", ["--model", "tiny-moe", "--ep", 3], 3, ["--ep 3", "8 experts", "'tiny-moe'"]),
    "GRPO init-from a pretraining checkpoint":
        ("fsdp2_grpo.py", ["--model", "tiny", *SFT_INIT], 1, ["--init-from", "fsdp2_pretrain.py", "chat format"]),
    "GRPO data with no reference answers":
        ("fsdp2_grpo.py", ["--model", "tiny", "--init-from", "{tmp}/sft", "--data", "{tmp}/no_solution"], 1,
         ["--reward exact-text", "--data", "<|begin_of_solution|>"]),
    "GRPO final-number reward on answers with no number":
        ("fsdp2_grpo.py", ["--model", "tiny", "--init-from", "{tmp}/sft", "--data", "{tmp}/spelling",
                           "--reward", "final-number"], 1,
         ["--reward final-number", "finds no answer"]),
    "SFT evaluation with a negative count":
        ("fsdp2_sft.py", ["--model", "tiny", "--eval-generate", -5], 1, ["--eval-generate", "at least 0"]),
    "GRPO group of one reply":
        ("fsdp2_grpo.py", ["--model", "tiny", "--group-size", 1], 1, ["--group-size", "at least 2"]),
    "GRPO more prompts per step than the data holds":
        ("fsdp2_grpo.py", ["--model", "tiny", "--init-from", "{tmp}/sft", "--prompts-per-step", 100000], 1,
         ["--prompts-per-step 100000", "at most"]),
    "GRPO resume with other prompts per step":
        ("fsdp2_grpo.py", [*TINY_RUN, *RL_DATA, "--prompts-per-step", 3, "--out-dir", "{tmp}/grpo10", "--resume"],
         1, ["--prompts-per-step 3", "as it was"]),
}


@pytest.fixture(scope="module")
def bad_input_files(tmp_path_factory, tiny_run):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty_folder").mkdir()
    (tmp / "blank.txt").write_text("  \n\n ")
    (tmp / "empty.jsonl").write_bytes(b"")
    (tmp / "text.parquet").write_text("plain text, not parquet\n")
    (tmp / "latin1.txt").write_bytes("Café au lait, crème brûlée.".encode("latin-1"))
    (tmp / "broken.jsonl").write_text(json.dumps({"text": "a good line"}) + '\n{"text": "cut short\n')
    (tmp / "content.jsonl").write_text(json.dumps({"content": "some text"}) + "\n")
    (tmp / "two_docs.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(2)))
    (tmp / "prompt_response.jsonl").write_text(json.dumps({"prompt": "2 + 2?", "response": "4"}) + "\n")
    (tmp / "input_output.jsonl").write_text(json.dumps({"input": "2 + 2?", "output": "4"}) + "\n")
    (tmp / "spelling.jsonl").write_text("".join(json.dumps({"prompt": f"Spell word {i}.", "answer": "w-o-r-d"}) + "\n"
                                                for i in range(20)))
    turns = [{"role": "user", "content": "2 + 2?"}, {"role": "tool", "content": "4"},
             {"role": "assistant", "content": "4"}]
    (tmp / "tool_role.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    (tmp / "no_assistant.jsonl").write_text(json.dumps({"messages": turns[:1]}) + "\n")
    (tmp / "mixed").mkdir()
    (tmp / "mixed" / "a.txt").write_text("some text")
    (tmp / "mixed" / "b.jsonl").write_text(json.dumps({"text": "more text"}) + "\n")
    shutil.copytree(tiny_run("ddp_pretrain.py")[0] / "checkpoints", tmp / "ddp" / "checkpoints")
    copy_checkpoint(tmp / "ddp", 10, tmp / "ddp10")
    shutil.copytree(tiny_run("fsdp2_pretrain.py")[0] / "checkpoints", tmp / "fsdp2" / "checkpoints")
    shutil.copytree(tiny_run("fsdp2_sft.py")[0] / "checkpoints", tmp / "sft" / "checkpoints")
    copy_checkpoint(tiny_run("fsdp2_grpo.py")[0], 10, tmp / "grpo10")
    # Conversations with no answer to check.
    greetings = [[{"from": "user", "value": f"Say hello {i} times."}, {"from": "assistant", "value": "Hello!"}]
                 for i in range(20)]
    (tmp / "no_solution.jsonl").write_text("".join(json.dumps({"conversations": turns}) + "\n" for turns in greetings))
    for name, kind in [("two_docs", "pretrain"), ("no_solution", "sft"), ("spelling", "sft")]:  # as prepared folders
        prepare_folder(tmp / f"{name}.jsonl", kind, tmp / name)
    shutil.copytree(tmp / "ddp", tmp / "truncated")
    weights = tmp / "truncated" / "checkpoints" / "step_20" / "checkpoint.pt"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy that ran out of disk
    FILES_AS_WRITTEN.update(tree_hashes(tmp))
    return tmp


FILES_AS_WRITTEN = {}  # sha256 of every file of bad_input_files, as the fixture wrote them


# One case per script and per way an error ends a run (argparse, a usage error, on 2 ranks): run as commands too.
COMMAND_LINE = ["step count that is not a number", "missing path inside a folder that exists (as README names "
                "prepared folders)", "more ranks than samples",
                "resume another strategy's checkpoint", "SFT data that is not prepared",
                "GRPO data with no reference answers"]  # TP's and PP's: argparse-free usage errors, as the others


def flags_of(case, files, tmp):
    """A case's flags; where it names none, --out-dir in tmp and the tests' prepared --data (the defaults, data/, are
    the checkout's)."""
    script, flags, nproc, _ = BAD_INPUTS[case]
    flags = [str(f).replace("{tmp}", str(files)) for f in flags]
    if "--out-dir" not in flags:
        flags += ["--out-dir", str(tmp / "run")]
    if script == "prepare_data.py":
        return [*flags, "--workers", "1"]
    if "--data" not in flags:
        flags += ["--data", str({"fsdp2_sft.py": BUILTIN_SFT, "fsdp2_grpo.py": BUILTIN_RL}.get(script, TINY_DATA))]
    return flags


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_clear_line_before_any_collective(case, bad_input_files, tmp_path, monkeypatch):
    script, _, nproc, words = BAD_INPUTS[case]
    before = tree_stats(bad_input_files)
    code, stderr = run_until_the_first_collective(script, flags_of(case, bad_input_files, tmp_path), nproc, monkeypatch)
    assert code == 2  # bad input's status: a UsageError's, as argparse's own
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(word in lines[0] for word in words), stderr
    assert tree_stats(bad_input_files) == before  # nothing written, created or removed (every byte: the last test)


@pytest.fixture(scope="module")
def command_line_runs(bad_input_files, tmp_path_factory):
    """{case: CompletedProcess} of COMMAND_LINE, two at a time (each spends most of its seconds importing torch)."""
    def run(case):
        script, _, nproc, _ = BAD_INPUTS[case]
        return run_script(script, *flags_of(case, bad_input_files, tmp_path_factory.mktemp("case")), nproc=nproc,
                          torchrun=nproc > 1)  # as a user runs them: torchrun reports its ranks' statuses

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(COMMAND_LINE, pool.map(run, COMMAND_LINE)))


@pytest.mark.parametrize("case", COMMAND_LINE)
@pytest.mark.slow  # multi-process runs of its own
def test_on_the_command_line_it_is_one_line_and_no_traceback(case, command_line_runs):
    _, _, nproc, words = BAD_INPUTS[case]
    result = command_line_runs[case]
    # One process exits with bad input's status; torchrun exits 1 and names its ranks' statuses.
    assert result.returncode == 2 if nproc == 1 else result.returncode == 1 and "exitcode  : 2 " in result.stderr
    output = result.stdout + result.stderr
    assert not traceback_through_our_code(output)  # torchrun's own failure report may follow
    assert nproc > 1 or "Traceback" not in output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and all(word in error_lines[0] for word in words), result.stderr
    if nproc > 1:  # torchrun's report ends with its root cause, the line again (the rank's error file), where one looks
        report = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        assert report[-2] == f"traceback : {error_lines[0]}", result.stderr[-3000:]


def test_a_damaged_checkpoint_is_a_checkpoint_error_not_bad_input(bad_input_files, tmp_path, monkeypatch):
    """A checkpoint file cut short after it was written (a copy that ran out of disk) is not the flags' fault: its own
    kind and exit status (3), in one line that names the file, before any collective; nothing is touched."""
    before = tree_stats(bad_input_files)
    flags = ["--model", "tiny", "--resume", str(bad_input_files / "truncated" / "checkpoints" / "step_20"),
             "--out-dir", str(tmp_path / "run")]
    code, stderr = run_until_the_first_collective("ddp_pretrain.py", flags, 1, monkeypatch)
    assert code == checkpoints.CheckpointError.exit_status == 3
    assert stderr.startswith("error: --resume") and "checkpoint.pt is 1000 bytes" in stderr and stderr.count("\n") == 1
    assert tree_stats(bad_input_files) == before


def empty_and_foreign_files(tmp):
    """{name: path}: an empty file of each suffix, a folder of empty files, files that are not what their suffix
    says."""
    tmp.mkdir()
    paths = {f"empty{suffix}": tmp / f"empty{suffix}" for suffix in prepare_data.DATA_SUFFIXES}
    for path in paths.values():
        path.write_bytes(b"")
    paths["folder of empty files"] = tmp / "empties"
    paths["folder of empty files"].mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (paths["folder of empty files"] / name).write_bytes(b"")
    paths["text in a .parquet"] = tmp / "text.parquet"
    paths["text in a .parquet"].write_text("plain text, not parquet\n")
    paths["binary in a .json"] = tmp / "binary.json"
    paths["binary in a .json"].write_bytes(bytes(range(256)) * 4)
    return paths


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_empty_or_foreign_data_files_are_one_error_line_and_write_nothing(kind, tmp_path):
    """In process, for speed: preparing them raises one UsageError line naming --data (the table above shows the
    command prints such a line once, with no traceback), and leaves no folder, partial or not; a training script
    given one says it is not prepared."""
    for name, path in empty_and_foreign_files(tmp_path / "data").items():
        with pytest.raises(common.UsageError) as error:
            prepare_folder(path, kind, tmp_path / "prepared" / "out")
        message = str(error.value)
        assert message.startswith(f"--data {path}") and "\n" not in message and len(message) < 400, (name, message)
        with pytest.raises(common.UsageError, match="no complete folder written by prepare_data.py"):
            data.open_prepared(path, "--data", conversations=kind == "sft")
    assert not list((tmp_path / "prepared").iterdir())


def test_no_case_changed_a_byte_of_the_files_they_read(bad_input_files):
    """After every case above (each checked the files' sizes and times), every file still holds its bytes."""
    assert FILES_AS_WRITTEN and tree_hashes(bad_input_files) == FILES_AS_WRITTEN
