"""fsdp2_tp_pretrain.py on CPU with gloo: tensor parallelism x FSDP2 trains as DDP does, splits what it says it
splits, moves exactly the collectives docs/parallelism.md states, and its checkpoints reshard into fsdp2_pretrain.py
and are read by generate.py (export_hf.py: test_export_hf.py; a crash and its resume: test_crash.py)."""
import json
import math

import torch

import common
import loading
import modeling
from helpers import REPO, TINY_RUN, assert_same_steps, check, copy_checkpoint, read_metrics, run_script, shown

TINY = {"hidden": 64, "intermediate": 256, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 50_304}


def test_each_tp_rank_holds_half_of_every_attention_and_mlp_matrix(tiny_run):
    out, result = tiny_run("fsdp2_tp_pretrain.py")
    shapes = json.loads((out.parent / "probe.json").read_text())["shapes"]
    h, i, head = TINY["hidden"], TINY["intermediate"], TINY["hidden"] // TINY["heads"]
    q, kv = h // 2, TINY["kv_heads"] * head // 2  # half the query heads, half the KV heads
    assert shapes == {"self_attn.q_proj.weight": [q, h], "self_attn.q_proj.bias": [q],
                      "self_attn.k_proj.weight": [kv, h], "self_attn.k_proj.bias": [kv],
                      "self_attn.v_proj.weight": [kv, h], "self_attn.v_proj.bias": [kv],
                      "self_attn.o_proj.weight": [h, q], "mlp.gate_proj.weight": [i // 2, h],
                      "mlp.up_proj.weight": [i // 2, h], "mlp.down_proj.weight": [h, i // 2],
                      "input_layernorm.weight": [h], "post_attention_layernorm.weight": [h]}
    # What each rank holds in all: half of every TP matrix, the norms whole, and the tied embedding and head ONCE
    # (untied, the head would be a second 50,304 x 64 matrix).
    per_layer = sum(math.prod(shape) for shape in shapes.values())
    held = TINY["vocab"] * h + TINY["layers"] * per_layer + h  # + the final norm
    assert held == 3_281_344
    for rank in (0, 1):
        assert f"rank {rank} holds {held:,} parameter and {2 * held:,} optimizer-state elements" in result.stdout


def test_one_layer_moves_exactly_the_collectives_the_docs_state(tiny_run):
    """Column-wise q, k, v, gate, up; row-wise o, down: the outputs of o and down are all-reduced in forward, the
    input gradients of the five column-wise projections in backward (CommDebugMode, one layer, no recompute)."""
    probe = json.loads((tiny_run("fsdp2_tp_pretrain.py")[0].parent / "probe.json").read_text())
    assert probe["forward"] == {"all_reduce": 2} and probe["backward"] == {"all_reduce": 5}


def test_a_tp_checkpoint_resumes_in_fsdp2_pretrain_on_1_process(tiny_run, tmp_path):
    """DCP reshards the dp 1 x tp 2 shards into FSDP2's 1D layout; 1 process with 2 micro-batches takes the same
    global batches, so the same steps (a TP checkpoint with replicas: test_fsdp2_3d_pretrain.py)."""
    tp_run = tiny_run("fsdp2_tp_pretrain.py")[0]
    resumed = copy_checkpoint(tp_run, 10, tmp_path / "on_1")
    result = check(run_script("fsdp2_pretrain.py", *TINY_RUN, "--grad-accum", 2, "--out-dir", resumed, "--resume"))
    assert "at step 10" in result.stdout
    assert sorted(read_metrics(resumed)[0]) == list(range(11, 21))
    assert_same_steps(resumed, tp_run, range(11, 21), 1e-4, 1e-4)


def test_generate_reads_a_tp_checkpoint_as_the_ddp_one_it_equals(tiny_run, ddp_one_process):
    flags = ["--prompt", "The interpreter", "--max-new-tokens", 12]
    printed = check(run_script("generate.py", tiny_run("fsdp2_tp_pretrain.py")[0], *flags)).stdout
    # The same greedy call in this process on DDP's step-20 checkpoint, which the TP run equals.
    model, _ = loading.load_checkpoint_model(loading.resolve_checkpoint(ddp_one_process))
    tokenizer = common.get_tokenizer()
    with torch.no_grad():
        reply = modeling.generate_replies(model, [tokenizer.encode_ordinary("The interpreter")], 12)[0]
    assert printed == "The interpreter" + shown(tokenizer.decode(reply)) + "\n" and len(reply) == 12


def test_norms_replicated_on_the_tp_mesh_count_once_in_the_gradient_norm(ddp_one_process, tmp_path):
    """A fork that puts each layer's norm weights on the tp mesh, replicated (as torchtitan's sequence parallelism
    does): their shares of the gradient norm, read from the placements, count each such weight once (a rule from the
    mesh's name would count it twice), so its steps, clipping active, equal DDP's."""
    source = (REPO / "fsdp2_tp_pretrain.py").read_text()
    anchor = '    parallelize_module(layer, mesh["tp"], layer_plan)\n'
    fork = anchor + (
        "    for norm in (layer.input_layernorm, layer.post_attention_layernorm):  # the fork: on the tp mesh too\n"
        "        distribute_module(norm, mesh['tp'], input_fn=lambda module, inputs, tp_mesh: tuple(\n"
        "            DTensor.from_local(x, tp_mesh, [Replicate()]) for x in inputs),\n"
        "            output_fn=lambda module, output, tp_mesh: output.to_local())\n")
    assert source.count(anchor) == 1
    imports = "import torch\nfrom torch.distributed.tensor import DTensor, Replicate, distribute_module\n"
    (tmp_path / "norms_on_tp.py").write_text(source.replace(anchor, fork).replace("import torch\n", imports, 1))
    out = tmp_path / "run"  # forked by the tests' zygote, whose imports hold our modules
    check(run_script(tmp_path / "norms_on_tp.py", *TINY_RUN, "--grad-accum", 2, "--out-dir", out, nproc=2))
    assert_same_steps(out, ddp_one_process, range(1, 21), 1e-5, 1e-5)
    assert any(row["grad_norm"] > 1.0 for row in read_metrics(out)[0].values())  # clipping active
