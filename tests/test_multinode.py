"""Multi-node launch: two torchrun agents on 127.0.0.1 (node ranks 0 and 1, c10d rendezvous)
form one 4-rank job through launch_grpo.sh and train end to end, tensor parallel within each
"node" and FSDP across them."""
import json
import os
import socket
import subprocess

from conftest import ROOT, read_jsonl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine_train_end_to_end(tmp_path):
    port = free_port()
    save = tmp_path / "run"
    overrides = ["trainer.total_steps=3", "trainer.test_freq=null", "actor.tp_size=2", "trainer.progress_bar=false",
                 "data.prompts_per_rollout=8", "data.responses_per_prompt=4"]
    procs = []
    for node in (0, 1):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "NPROC": "2", "SAVE_DIR": str(save)}
        procs.append(subprocess.Popen(["bash", str(ROOT / "launch_grpo.sh"), *overrides], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=400)
        finally:
            p.kill()
        outputs.append(out)
    for node, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node}:\n{out[-4000:]}"
    assert any("4 ranks on 2 node(s); actor ddp=1 fsdp=2 tp=2 sp=1 dp=2" in out for out in outputs)
    steps = [row["step"] for row in read_jsonl(save / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    layout = [json.loads(line) for line in open(save / "trajectories.jsonl") if '"layout"' in line][0]
    assert layout["world_size"] == 4 and layout["nodes"] == 2
    assert (save / "latest" / "config.json").exists()  # the final export gathered every shard
