"""Two torchrun agents (--nnodes=2, one process each) meeting through c10d rendezvous on 127.0.0.1."""

import subprocess

from support import cli, free_port, job_args, read_summary, subprocess_env


def test_two_nodes_train_to_the_end_with_identical_weights(tmp_path):
    port = free_port()
    run_dir, snaps = tmp_path / "run", tmp_path / "snaps"
    env = subprocess_env(tmp_path)
    agents = []
    for node_rank in (0, 1):
        torchrun = ["--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes"]
        command = cli(job_args(snaps, run_dir, max_steps=30, save_every_steps=1000), torchrun)
        log = (tmp_path / f"node{node_rank}.log").open("w")
        agents.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [agent.wait(timeout=240) for agent in agents]
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], logs
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert len(set(summary["rank_weights_sha256"])) == 1 and summary["replicas_identical"]
    # One snapshot (the end of training), written once, by global rank 0 only.
    assert [p.name for p in snaps.iterdir()] == ["snapshot-000000030.pt"]
    saves = sum(log.count("snapshot-000000030.pt saved") for log in logs)
    assert saves == 1, logs
