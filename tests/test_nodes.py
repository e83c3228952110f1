"""Two torchrun "nodes" on this machine, joined by c10d rendezvous, run TSP, KVR and ring as two machines would.

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 1`` agent; they find each other through the
rendezvous endpoint only (no --master-addr), as agents on two machines do. Rank 0 reports the run, and
``--check`` compares its first-token logits with one process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from toyllm.launch import free_port

ATOL = 1e-4
CONTEXT = 37
# (method, extra arguments, the exercise it runs): in the student edition an unwritten one skips the case.
CASES = [pytest.param("tsp", [], marks=pytest.mark.needs("4.2"), id="tsp"),
         pytest.param("kvr", ["--partition", "30,7"], marks=pytest.mark.needs("5.2"), id="kvr"),
         pytest.param("ring", [], marks=pytest.mark.needs("9.1", "9.2", "9.3"), id="ring")]


def _node(port: int, run_id: str, method: str, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
           "--max-restarts=0", "-m", "toyllm", "prefill", "--model", "tiny", "--context", str(CONTEXT),
           "--method", method, *extra, "--repeat", "1", "--check", "--json"]
    # GLOO_SOCKET_IFNAME: the interface gloo's ranks talk over (on two real machines, the one they share)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.engine
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method, extra", CASES)
def test_two_nodes_joined_by_rendezvous_equal_one_process(method, extra):
    port = free_port()
    nodes = [_node(port, f"toyllm-{method}-{port}", method, extra) for _ in range(2)]
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=200))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-3000:]
    reports = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert len(reports) == 1, outs                 # rank 0 alone reports, on whichever node it landed
    report = reports[0]
    assert report["world_size"] == 2 and report["method"] == method
    assert report["max_abs_logit_diff"] < ATOL
