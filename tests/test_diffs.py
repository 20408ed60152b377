"""The scripts stay diffable: each diff between neighbouring scripts changes only the sections that its strategy or
stage changes (the scripts' `# ---- name` headers; "preamble" is the docstring and the imports), each by at most the
lines pinned here, so that a stray edit in one copy fails. docs/diffs.md walks through every hunk."""
import re
import subprocess
from collections import Counter

import pytest

from helpers import REPO

# (before, after): {section: changed lines at most}. A section missing here may not change at all.
DIFFS = {
    ("ddp_pretrain.py", "fsdp1_pretrain.py"):  # the wrapper, its precision, its checkpoint format, its no_sync and norm
        {"preamble": 15, "setup": 3, "model": 5, "wrap": 12, "training step": 11, "checkpoint": 36, "evaluation": 3},
    ("fsdp1_pretrain.py", "fsdp2_pretrain.py"):  # fully_shard, ZeRO-2, model and optimizer apart, the resuming scripts
        {"preamble": 17, "setup": 5, "model": 2, "wrap": 12, "training step": 16, "checkpoint": 35},
    ("fsdp2_pretrain.py", "fsdp2_tp_pretrain.py"):  # the 2D mesh: the tp plan, dp ranks reading, the norm's two meshes
        {"preamble": 9, "setup": 13, "data": 2, "distributed": 5, "model": 5, "tensor parallel": 15, "wrap": 9,
         "training step": 15, "resume": 2, "evaluation": 4, "training loop": 7},
    ("fsdp2_pretrain.py", "fsdp2_cp_pretrain.py"):  # the 2D mesh: the zigzag split, its attention, dp ranks reading
        {"preamble": 8, "setup": 12, "data": 2, "distributed": 4, "model": 5, "context parallel": 47, "wrap": 1,
         "training step": 6, "resume": 2, "evaluation": 7, "training loop": 4},
    ("fsdp2_cp_pretrain.py", "fsdp2_3d_pretrain.py"):  # one mesh: HSDP's replicas, the tp plan, the loss's group
        {"preamble": 10, "setup": 26, "distributed": 15, "model": 4, "context parallel": 4, "tensor parallel": 9,
         "wrap": 11, "training step": 15, "evaluation": 2, "training loop": 3},
    ("ddp_pretrain.py", "pp_pretrain.py"):  # the stage module, its schedule per bucket, the tied weight's two copies
        {"preamble": 15, "setup": 17, "data": 2, "distributed": 5, "model": 28, "wrap": 4, "pipeline": 20,
         "training step": 32, "checkpoint": 28, "resume": 2, "evaluation": 8, "training loop": 4},
    ("fsdp2_pretrain.py", "fsdp2_muon_pretrain.py"):  # Muon for the layers' matrices, over FSDP2's shards; its resume
        {"preamble": 15, "setup": 8, "optimizer": 74, "resume": 3},
    ("fsdp2_pretrain.py", "fsdp2_ep_pretrain.py"):  # the experts dealt over ep, the all-to-all, the balance loss
        {"preamble": 28, "setup": 12, "distributed": 5, "model": 7, "expert parallel": 51, "wrap": 8,
         "training step": 34, "training loop": 14},
    ("fsdp2_pretrain.py", "fsdp2_sft.py"):  # chat data, its init read shard by shard, the marker rows, accuracy
        {"preamble": 38, "setup": 14, "data": 13, "model": 2, "init from a checkpoint": 17, "evaluation": 16, "end": 4},
    ("fsdp2_sft.py", "fsdp2_lora_sft.py"):  # the adapters and token rows, the frozen base read whole, its digest
        {"preamble": 22, "setup": 40, "model": 58, "init from a checkpoint": 10, "optimizer": 8, "training step": 4,
         "checkpoint": 15, "training loop": 2},
    ("fsdp2_sft.py", "fsdp2_grpo.py"):  # prompts and rewards, rollouts, the advantage and the policy-gradient loss
        {"preamble": 28, "setup": 21, "data": 25, "wrap": 3, "init from a checkpoint": 9, "training step": 18,
         "resume": 5, "evaluation": 11, "rollouts": 11, "training loop": 71},
}
SECTION = re.compile(r"^# -{20,} (.+)$")
HUNK = re.compile(r"^(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?$")  # diff's own: 33c36,49, 7a8, 12d11


def section_of_each_line(path):
    names, current = [], "preamble"
    for line in path.read_text().splitlines():
        current = match.group(1) if (match := SECTION.match(line)) else current
        names.append(current)
    return names


def changed_lines_by_section(before, after):
    """{section: lines that `diff before after` changes in it}: a removed line counts in its section of BEFORE, an
    added one in its section of AFTER."""
    diff = subprocess.run(["diff", before, after], capture_output=True, text=True).stdout
    sections = {"before": section_of_each_line(before), "after": section_of_each_line(after)}
    changed = Counter()
    for first, last, kind, new_first, new_last in (match.groups() for match in map(HUNK.match, diff.splitlines())
                                                   if match):
        if kind in "cd":
            changed.update(sections["before"][int(first) - 1:int(last or first)])
        if kind in "ca":
            changed.update(sections["after"][int(new_first) - 1:int(new_last or new_first)])
    return changed


def outside_the_pins(changed, pins):
    return {section: lines for section, lines in changed.items() if lines > pins.get(section, 0)}


@pytest.mark.parametrize("before,after", DIFFS)
def test_a_diff_changes_only_what_its_strategy_or_stage_changes(before, after):
    changed = changed_lines_by_section(REPO / before, REPO / after)
    print(f"diff {before} {after}: {sum(changed.values())} changed lines, {dict(changed)}")
    assert changed and not outside_the_pins(changed, DIFFS[before, after])


def test_a_stray_rename_in_one_copy_fails(tmp_path):
    """fsdp2_pretrain.py with one variable renamed, as a fix made in one copy only would: its diff against
    fsdp1_pretrain.py now changes the evaluation and the training loop, which FSDP2 does not change, and more of the
    training step."""
    renamed = tmp_path / "fsdp2_pretrain.py"
    renamed.write_text((REPO / "fsdp2_pretrain.py").read_text().replace("loss_sum", "summed_loss"))
    pins = DIFFS["fsdp1_pretrain.py", "fsdp2_pretrain.py"]
    assert not outside_the_pins(changed_lines_by_section(REPO / "fsdp1_pretrain.py", REPO / "fsdp2_pretrain.py"), pins)
    outside = outside_the_pins(changed_lines_by_section(REPO / "fsdp1_pretrain.py", renamed), pins)
    assert set(outside) == {"evaluation", "training step", "training loop"}, outside
