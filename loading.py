"""What the tools and tests read of the training scripts: any checkpoint, or an export_hf.py folder, as one plain model
in one process with no process group (the training scripts load their own, in their strategy's way); a script's
PRESETS."""
import ast
import hashlib
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import checkpoints
import common
import modeling


def resolve_checkpoint(path):
    """A checkpoint folder (step_<N>), or a run's --out-dir meaning its newest complete checkpoint."""
    checkpoint_dir = checkpoints.newest_checkpoint(path)
    if checkpoint_dir is None:
        raise common.UsageError(f"{path} is neither a checkpoint folder (step_N with meta.json) nor a run folder "
                                f"holding one")
    return checkpoint_dir


def load_checkpoint_model(checkpoint_dir, device="cpu", base=None):
    """A plain, unsharded model with the weights of a checkpoint of any script (or an exported folder), in one
    process and with no process group: DCP reads sharded checkpoints into whole tensors by itself. The layout is told
    by the files:

        "export" in meta its model.safetensors             (an export_hf.py folder; a MoE's read by transformers)
        checkpoint.pt    its "model" entry                 (torch.save by rank 0: DDP)
        model/           the whole folder                  (DCP, model saved apart from the optimizer: FSDP2)
        otherwise        the app state's "model" entry     (DCP, one Stateful app state: FSDP1)
    """
    meta = checkpoints.read_meta(checkpoint_dir, "checkpoint")
    moe = meta["model"] in modeling.MOE_PRESETS  # fsdp2_ep_pretrain.py's: its experts run as transformers' own
    model = (modeling.build_moe_model if moe else modeling.build_model)(meta["model"]).eval()
    state = model.state_dict()
    try:
        if "lora_rank" in meta["config"] and "export" not in meta:  # adapters (fsdp2_lora_sft.py), merged into the base
            return lora_parts(checkpoint_dir, merged=True, base=base)[0].to(device), meta
        if "export" in meta and moe:  # each expert's matrices apart, as transformers writes them: it fuses them again
            from transformers import Qwen2MoeForCausalLM
            state = Qwen2MoeForCausalLM.from_pretrained(checkpoint_dir).state_dict()
        elif "export" in meta:
            state = checkpoints.hf_state_dict(checkpoint_dir)
        elif (Path(checkpoint_dir) / "checkpoint.pt").is_file():
            state = torch.load(Path(checkpoint_dir) / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
        elif (Path(checkpoint_dir) / "model").is_dir():
            dcp.load(state, checkpoint_id=Path(checkpoint_dir) / "model")
        else:
            dcp.load({"app": {"model": state}}, checkpoint_id=checkpoint_dir)  # reads only the model's entries
        model.load_state_dict(state)
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError, CheckpointException) as exc:
        # The sizes were right (read_meta), the bytes or the tensors are not: say which checkpoint, in one line.
        raise checkpoints.CheckpointError(f"checkpoint {checkpoint_dir} cannot be read ({common.error_reason(exc)}): "
                                          f"it is damaged or not of these scripts") from None
    return model.to(device), meta


def lora_parts(checkpoint_dir, merged=False, base=None):
    """A fsdp2_lora_sft.py checkpoint's base (where the run recorded it, or `base`: where it lies now; checked by its
    meta.json's sha256; a 4-bit one dequantized) and what trained, whole, named as in the model ({module}.lora_A.weight,
    ...B.weight, the token rows' model.embed_tokens.trainable_tokens_delta (added to the base's rows) or the whole
    model.embed_tokens.weight); merged: W + (alpha / r) B A, and the trained rows in the embedding."""
    config = checkpoints.read_meta(checkpoint_dir, "checkpoint")["config"]
    base_dir = checkpoints.newest_checkpoint(base or config["init_from"])
    if base_dir is None or config.get("base_sha256", digest(base_dir)) != digest(base_dir):
        found = "is not that base" if base_dir else "holds no checkpoint"
        raise common.UsageError(f"--base {base or config['init_from']} {found}: the LoRA run {checkpoint_dir} trained "
                                f"on {config['init_from']}; pass --base where that base lies now")
    model, _ = load_checkpoint_model(base_dir)
    if (rows := torch.load(Path(checkpoint_dir) / "train_state.pt", weights_only=True).get("marker_rows")) is not None:
        model.model.embed_tokens.weight.data[common.EOT_ID + 1:common.EOT_ID + 1 + len(rows)] = rows  # older runs'
    stored = dcp.FileSystemReader(Path(checkpoint_dir) / "model").read_metadata().state_dict_metadata  # their shapes
    adapters = {name: torch.empty(entry.size) for name, entry in stored.items()}
    dcp.load(adapters, checkpoint_id=Path(checkpoint_dir) / "model")
    for name, module in model.named_modules():
        if (a := adapters.get(f"{name}.lora_A.weight")) is not None and config.get("base_dtype") == "nf4":
            from torchao.quantization import to_nf4  # what the run computed with: the base's 4-bit round trip
            module.weight.data = to_nf4(module.weight.data, 64, module.in_features // 64).get_original_weight()
        if a is not None and merged:
            module.weight.data += config["lora_alpha"] / config["lora_rank"] * adapters[f"{name}.lora_B.weight"] @ a
    if merged and "model.embed_tokens.weight" in adapters:  # --train-embedding's: the whole matrix, the head tied
        model.model.embed_tokens.weight.data.copy_(adapters["model.embed_tokens.weight"])
    if merged and (delta := adapters.get("model.embed_tokens.trainable_tokens_delta")) is not None:
        model.model.embed_tokens.weight.data[config["trainable_tokens"]] += delta
    return model, adapters


def digest(checkpoint_dir):
    """A checkpoint's identity wherever it lies: the sha256 of its meta.json (its step, flags and every file's size)."""
    return hashlib.sha256((Path(checkpoint_dir) / "meta.json").read_bytes()).hexdigest()


def script_presets(script):
    """The PRESETS a training script defines, read from its source (a script runs when imported): for the tools and
    tests that parse a script's flags as it does."""
    tree = ast.parse((Path(__file__).parent / script).read_text())
    node = next(node for node in tree.body if getattr(getattr(node, "targets", [None])[0], "id", None) == "PRESETS")
    return eval(compile(ast.Expression(node.value), script, "eval"), {"__builtins__": {}, "dict": dict})  # dicts only
