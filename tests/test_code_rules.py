"""Rules the code itself must keep, checked on its syntax tree: safe loading, and no collective that only rank 0 reaches."""
import ast

import pytest

from helpers import REPO

SOURCES = sorted(p for p in REPO.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(REPO).parts))  # no venvs
TRAINING_SCRIPTS = ["ddp_pretrain.py", "fsdp1_pretrain.py", "fsdp2_pretrain.py", "fsdp2_sft.py", "fsdp2_grpo.py"]


def calls(tree):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def call_name(call):
    """`torch.load` for torch.load(...), `dist.barrier` for dist.barrier(...), `evaluate` for evaluate(...)."""
    parts, func = [], call.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_torch_load_only_with_weights_only_and_no_remote_code(path):
    tree = ast.parse(path.read_text())
    for call in calls(tree):
        keywords = {k.arg: k.value for k in call.keywords}
        if call_name(call) == "torch.load":  # weights_only=True unpickles tensors and plain data, never code
            assert isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is True, \
                f"{path.name}:{call.lineno}: torch.load without weights_only=True"
        assert "trust_remote_code" not in keywords, f"{path.name}:{call.lineno}: trust_remote_code runs a download's code"


# Calls that every rank must make together: torch.distributed and DCP, FSDP's full_tensor, the model's forward
# (FSDP gathers parameters in it), generation, and the scripts' own functions built on these.
COLLECTIVE = ("dist.", "dcp.", "get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict",
              "set_optimizer_state_dict", "get_state_dict", "set_state_dict", "full_tensor", "model", "model.state_dict", "model.generate",
              "evaluate", "save_checkpoint", "load_checkpoint", "common.generate_replies", "common.stop_if_nonfinite")


def is_rank_zero_test(test):
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "rank"
            and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 0)


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_no_collective_inside_a_rank_zero_branch(script):
    """A collective that only rank 0 reaches waits for the other ranks forever: the classic distributed hang."""
    tree = ast.parse((REPO / script).read_text())
    branches = [node for node in ast.walk(tree) if isinstance(node, ast.If) and is_rank_zero_test(node.test)]
    assert len(branches) >= 5  # the checkpoint writes, the logging, the progress bar, the summary
    for branch in branches:
        for call in calls(ast.Module(body=branch.body, type_ignores=[])):
            name = call_name(call)
            assert not (name.startswith(COLLECTIVE[:2]) or name in COLLECTIVE or name.endswith(".full_tensor")), \
                f"{script}:{call.lineno}: {name}() inside `if rank == 0:`"
