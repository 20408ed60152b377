"""Two torchrun agents (two "nodes", one process each) meeting through c10d rendezvous on loopback train
exactly as one agent with two processes does: fsdp2_3d_pretrain.py with a replica per node (HSDP, --dp-replicate 2)
as fsdp2_pretrain.py sharding over both ranks."""
import os
import subprocess

import pytest

from helpers import PYTHON, REPO, TINY_RUN, free_port, read_metrics


def test_two_agents_with_a_replica_each_match_one_agent_with_two_processes(tiny_run, tmp_path):
    single_node_dir, _ = tiny_run("fsdp2_pretrain.py")
    out = tmp_path / "two_nodes"
    launcher = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=loopback-test"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"}
    command = [*launcher, str(REPO / "fsdp2_3d_pretrain.py"), *map(str, TINY_RUN), "--dp-replicate", "2",
               "--out-dir", str(out)]
    agents = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    two_nodes, single_node = read_metrics(out)[0], read_metrics(single_node_dir)[0]
    assert sorted(two_nodes) == sorted(single_node) == list(range(1, 21))
    for step in single_node:
        assert two_nodes[step]["loss"] == pytest.approx(single_node[step]["loss"], abs=1e-6), step
        assert two_nodes[step]["grad_norm"] == pytest.approx(single_node[step]["grad_norm"], rel=1e-5), step
    # Each node's replica is whole (one GPU per node: a shard of one), where fsdp2_pretrain.py halves the model.
    assert all("holds 3,342,912 parameter and 6,685,824 optimizer-state elements" in output for output in outputs)
