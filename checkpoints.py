"""Checkpoint bookkeeping shared by every script: find, commit, verify and prune; a failed save, reported; --resume and
--init-from, found and checked; an export read back. Each strategy's save and load is in its script; loading.py reads
any, for the tools."""
import contextlib
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import common


class CheckpointError(common.ReportedError):
    """A checkpoint (or export) damaged since written, unlike on other ranks, or not fitting the model. Exit 3."""
    exit_status = 3


class SaveFailed(common.ReportedError):
    """A checkpoint the filesystem would not take (no space left, a read-only folder). Exit status 8."""
    exit_status = 8


# ----------------------------------------------------------------------------------------------
# Finding, committing and pruning. A save writes into a hidden .partial_step_<N> folder, renamed to step_<N> once
# complete, with meta.json written last: a crash at any moment leaves no step_<N> folder that is not whole.


def complete_checkpoints(checkpoint_root):
    """Committed checkpoints (step_<N> folders holding a meta.json), oldest first."""
    found = [p for p in Path(checkpoint_root).glob("step_*") if p.name[5:].isdigit() and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def newest_checkpoint(path):
    """PATH itself if it is a complete checkpoint folder, else the newest one of the run folder PATH, or None."""
    path = Path(path)
    found = [path] if (path / "meta.json").is_file() else complete_checkpoints(path / "checkpoints")
    return found[-1] if found else None


def commit_checkpoint(partial_dir, args, script, step, world_size, data_order, resumed_by, chat_format):
    """Rank 0, once every rank has written: add meta.json (what --resume and the tools check without reading the
    weights), rename to step_<N>, drop the oldest beyond --keep-last."""
    files = {str(f.relative_to(partial_dir)): f.stat().st_size for f in sorted(partial_dir.rglob("*")) if f.is_file()}
    meta = {"script": script, "resumed_by": resumed_by, "chat_format": chat_format, "model": args.model,
            "vocab_size": common.VOCAB_SIZE, "step": step, "world_size": world_size, "data": args.data,
            "config": common.flag_values(args),  # a resume says which flags it changed (check_resume)
            "data_order": data_order,  # what a resume may not change (check_resume)
            "files": files}  # every file's size: a truncated or missing file is caught before anything loads
    (partial_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    os.replace(partial_dir, partial_dir.parent / f"step_{step}")  # atomic: the checkpoint appears whole or not at all
    for old in complete_checkpoints(partial_dir.parent)[:-args.keep_last]:  # never the newest: keep_last >= 1
        removing = old.with_name(f".removing_{old.name}")
        os.replace(old, removing)  # hidden first, so a crash mid-delete leaves no half-deleted step_<N>
        shutil.rmtree(removing)


@contextlib.contextmanager
def report_failure(out_dir, step):
    """Around save_checkpoint(step, ...): a save the filesystem refuses is one line. Its partial folder is never
    committed, so every complete checkpoint stays whole; the free space, or the folder's mode, says what refused it."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as error:  # DCP's: every rank's failures, on every rank
        causes = (error.failures.values() if isinstance(error, CheckpointException)  # (failure, its stack) a rank
                  else [(error, traceback.extract_tb(error.__traceback__))])
        if not (refused := [e for e, stack in causes if isinstance(e, OSError)  # or anything inside torch.save's write,
                            or torch.serialization.__file__ in {frame.filename for frame in stack or ()}]):  # any byte
            raise  # not the filesystem's refusal: a dead peer, a bug, ...
        free = shutil.disk_usage(out_dir).free / 1e9 if os.access(out_dir, os.W_OK) else None  # None: not writable
        with contextlib.suppress(OSError):  # stderr may be a file on the disk that is full
            print(file=sys.__stderr__)  # end the progress bar's line
        raise SaveFailed(f"--out-dir {out_dir}: saving step {step} failed ({type(refused[0]).__name__}: {refused[0]}; "
                         f"{'the folder is not writable' if free is None else f'{free:.1f} GB free'}): every "
                         f"complete checkpoint is whole; free space or fix the folder, then rerun with --resume auto")


def remove_incomplete_checkpoints(checkpoint_root):
    """Rank 0, on start: free the disk of a crashed run's uncommitted saves and unfinished deletions."""
    for leftover in [*Path(checkpoint_root).glob(".partial_step_*"), *Path(checkpoint_root).glob(".removing_step_*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def read_meta(checkpoint_dir, flag, model=None):
    """The meta.json of a complete checkpoint (or export_hf.py) folder whose files have their sizes, and of `model`
    if given; else one line."""
    try:
        meta = json.loads((Path(checkpoint_dir) / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or not all(key in meta for key in ("script", "model", "step")):
        raise common.UsageError(f"{flag} {checkpoint_dir} is not a complete checkpoint of these scripts "
                                f"(no readable meta.json)")
    for name, size in meta.get("files", {}).items():  # the sizes recorded at commit
        path = Path(checkpoint_dir) / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise CheckpointError(f"{flag} {checkpoint_dir} is damaged: {name} is {found}, {size} bytes were "
                                  f"written; pass an older checkpoint folder")
    if model is not None and meta["model"] != model:
        raise common.UsageError(f"{flag} {checkpoint_dir} holds a '{meta['model']}' model: pass --model "
                                f"{meta['model']}")
    return meta


# ----------------------------------------------------------------------------------------------
# --resume and --init-from: found and checked before any rank talks.

def find_resume_checkpoint(args, checkpoint_root, script):
    """The checkpoint folder --resume asks for (None for a fresh run)."""
    existing = complete_checkpoints(checkpoint_root)
    if args.resume is None or (args.resume == "auto" and not existing):  # auto: one command starts and continues
        if existing:
            raise common.UsageError(f"{checkpoint_root} already holds checkpoints (newest {existing[-1].name}): pass "
                                    f"--resume to continue, or choose another --out-dir")
        return None
    if args.resume == "latest" and not existing:
        raise common.UsageError(f"--resume: no complete checkpoint under {checkpoint_root}: drop --resume to start "
                                f"fresh, or check --out-dir")
    checkpoint_dir = existing[-1] if args.resume in ("latest", "auto") else Path(args.resume)
    meta = read_meta(checkpoint_dir, "--resume", args.model)
    resumed_by = [f"{name}.py" for name in meta.get("resumed_by", [meta["script"]])]  # an export's: none
    if f"{script}.py" not in resumed_by:
        raise common.UsageError(f"--resume {checkpoint_dir} was written by {meta['script']}.py, not {script}.py: "
                                f"resume it with {' or '.join(resumed_by) or 'none (an export: --init-from it)'}")
    if newer := [p for p in existing if int(p.name[5:]) > meta["step"]]:  # saving on from here would collide with them
        raise common.UsageError(f"--resume {checkpoint_dir}: {checkpoint_root} already holds newer checkpoints "
                                f"({newer[-1].name}): move them away or use another --out-dir")
    if meta["step"] >= args.max_steps and args.resume != "auto":  # (auto: a finished run ends in same_on_every_rank)
        raise common.UsageError(f"--max-steps {args.max_steps}: --resume {checkpoint_dir} is at step {meta['step']} "
                                f"already, nothing to train: raise --max-steps")
    return checkpoint_dir


def same_on_every_rank(resume_dir, init_dir, args):
    """Before any load: each rank found its checkpoint in its own listing, which a shared filesystem may cache."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, str(resume_dir or init_dir))
    if len(set(found)) > 1:
        raise CheckpointError(f"the ranks found different checkpoints ({', '.join(sorted(set(found)))}): pass one")
    if resume_dir and (step := read_meta(resume_dir, "--resume")["step"]) >= args.max_steps:  # auto's: a requeued job
        if dist.get_rank() == 0:
            print(f"already finished at step {step} ({resume_dir}): nothing to train", flush=True)
        dist.barrier()  # gloo's, before the group is destroyed
        dist.destroy_process_group()
        sys.exit(0)


ORDER_FLAGS = {"data_sha256": "--data", "val_fraction": "--val-fraction", "buckets": "--buckets",
               "bucket_order": "--bucket-order", "seed": "--seed"}
UNREPORTED_FLAGS = ("resume", "out_dir", "init_from")  # expected to differ on a resume, or unused by it


def check_resume(resume_dir, args, data_order):
    """On --resume: the data order (data.data_order) must be the checkpoint's, else its data position points into
    another order. Any other flag may change, from the next step: said once, here."""
    if resume_dir is None:
        return
    meta = read_meta(resume_dir, "--resume")
    batch = " x ".join(f"--{name.replace('_', '-')} {getattr(args, name)}" for name in data_order["batch_flags"])
    samples = f"{batch} x {data_order['world_size']} ranks (samples per step by bucket)"  # the ranks may change
    for key, flag in {**ORDER_FLAGS, "samples_per_step": samples}.items():
        if key in data_order and meta["data_order"].get(key) != data_order[key]:
            raise common.UsageError(f"{flag} differs from the run of --resume {resume_dir} ({data_order[key]} here, "
                                    f"{meta['data_order'].get(key)} there), and the data order depends on it: keep it "
                                    f"as it was")
    before, now = meta.get("config", {}), common.flag_values(args)  # every flag of the checkpoint's run, and this one's
    changed = [f"--{name.replace('_', '-')} {value} (was {before[name]})" for name, value in now.items()
               if name in before and name not in UNREPORTED_FLAGS and before[name] != value]
    if changed and int(os.environ.get("RANK", 0)) == 0:  # said once; every rank applies them alike
        print(f"changed against the checkpoint: {', '.join(changed)}; this run's values apply from step "
              f"{meta['step'] + 1}", flush=True)


def find_init_checkpoint(args, writers):
    """--init-from: a checkpoint folder, or a run folder's newest, written by one of `writers` (the scripts whose
    layout this script reads; "export_hf": an export_hf.py folder)."""
    checkpoint_dir = newest_checkpoint(args.init_from)
    if checkpoint_dir is None:
        raise common.UsageError(f"--init-from {args.init_from} holds no complete checkpoint: run `torchrun "
                                f"--standalone --nproc_per_node=2 {writers[0]}.py --model {args.model}` first, or pass "
                                f"a checkpoint folder or a run folder")
    meta = read_meta(checkpoint_dir, "--init-from", args.model)
    writer = "export_hf" if "export" in meta else meta["script"]
    if writer not in writers:
        raise common.UsageError(f"--init-from {checkpoint_dir} was written by {writer}.py, whose checkpoints this "
                                f"script does not start from: pass one of {', '.join(f'{w}.py' for w in writers)}")
    return checkpoint_dir


# ----------------------------------------------------------------------------------------------
# An exported Hugging Face folder, read back (--init-from; loading.py for the tools).

def is_hf_folder(path):
    """A Hugging Face model folder, as export_hf.py writes: config.json beside model.safetensors."""
    return (Path(path) / "config.json").is_file() and (Path(path) / "model.safetensors").is_file()


def hf_state_dict(path):
    """Whole tensors of an exported folder, named as in the model: the tied head added back, and the Llama form's
    o_proj biases (export_hf.py), which our Qwen2 does not have, dropped if zero."""
    from safetensors.torch import load_file

    state = load_file(Path(path) / "model.safetensors")
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    for name in [name for name in state if name.endswith("o_proj.bias")]:
        if state.pop(name).any():
            raise CheckpointError(f"{path}: {name} is not zero, so a Qwen2 model cannot hold these weights: load it "
                                  f"with transformers instead")
    return state
