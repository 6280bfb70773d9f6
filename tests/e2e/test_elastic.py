"""Elastic membership: `torchrun --nnodes=1:2` agents meeting through c10d on 127.0.0.1, as the README documents it
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's environment). A node is lost (its agent and worker
SIGKILLed), the survivor goes on alone, the node comes back (its agent started again), both finish at max_steps,
and the global sample position is exact through 2 -> 1 -> 2. Then the one-line stops: the elastic command without
the variable, ranks that cannot meet, and a node handed its own agent's stale store (torch 2.13's bug)."""

import datetime
import os
import re
import signal
import subprocess

import pytest
import torch.distributed as dist
from support import (
    children,
    cli,
    free_port,
    job_args,
    kill_all,
    logged_step,
    read_summary,
    resumes,
    subprocess_env,
    wait_for,
)

from mingpt.checkpoint import store as snapshot_format
from mingpt.reporting.logs import read_metrics

BATCH = 8  # trainer_config.batch_size of TINY: global samples per step = BATCH x nodes
MAX_STEPS = 40
# last_call_timeout: how long the first round waits for a second agent (both start together; 30 s by default)
RDZV_CONF = "last_call_timeout=3,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"


def elastic_agent(tmp_path, name, port, is_host, env, extra_args=(), max_restarts=3):
    """One node: the README's elastic command; `is_host` pins which agent hosts the rendezvous store (the one the
    test keeps), `keep_alive_*` make the lost node's heartbeat expire in 3 s, not 15."""
    torchrun = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=elastic", f"--max-restarts={max_restarts}",
                f"--rdzv_conf={RDZV_CONF},is_host={str(is_host).lower()}"]
    command = cli(job_args(tmp_path / "snaps", tmp_path / "run", *extra_args, max_steps=MAX_STEPS, log_every_steps=1,
                           save_every_steps=4, eval_every_steps=100000), torchrun)
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)


def kill_agents(*agents):
    for agent in agents:
        kill_all([*children(agent.pid), agent.pid])  # workers run in sessions of their own
        agent.wait()


def test_a_node_leaves_and_rejoins_with_the_exact_sample_position(tmp_path):
    port, run_dir, snaps = free_port(), tmp_path / "run", tmp_path / "snaps"
    env = {**subprocess_env(tmp_path), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    a = elastic_agent(tmp_path, "a", port, True, env)
    b = elastic_agent(tmp_path, "b", port, False, env)
    agents = [a, b]
    train_log = lambda: (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""  # noqa: E731
    try:
        # 2 nodes: once a snapshot exists (step 4), node b is lost, agent and worker at once.
        wait_for(lambda: logged_step(run_dir) >= 6 and list(snaps.glob("snapshot-*.pt")), 120, what="2 nodes train")
        kill_agents(b)
        # 1 node: a's worker fails on its next collective; a's agent meets alone and starts a new worker, which
        # resumes. It is paused (SIGSTOP) a few steps later, so that the alone phase stays short whatever the speed.
        wait_for(lambda: len(rows_since_resume(run_dir, train_log())) >= 2, 120, what="a resumes and trains alone")
        (worker,) = children(a.pid)
        os.kill(worker, signal.SIGSTOP)
        sigterms = (tmp_path / "a.log").read_text().count("closing signal SIGTERM")
        # 2 nodes again: b's agent starts; a's agent sees a waiting node and SIGTERMs its worker, which saves
        # (once it runs again) and exits; both agents meet and start one worker each.
        b = elastic_agent(tmp_path, "b2", port, False, env)
        agents = [a, b]
        wait_for(lambda: (tmp_path / "a.log").read_text().count("closing signal SIGTERM") > sigterms, 120,
                 what="a's agent stops its worker for the rejoining node")
        os.kill(worker, signal.SIGCONT)
        codes = [a.wait(timeout=180), b.wait(timeout=60)]
    finally:
        kill_agents(*agents)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("a", "b", "b2")}
    assert codes == [0, 0], "\n".join(f"--- {n}\n{text[-3000:]}" for n, text in logs.items())

    text = train_log()
    worlds = [int(n) for n in re.findall(r"training: steps .*?, (\d+) process\(es\)", text)]
    assert worlds == [2, 1, 2], text  # (a first [1, ...]: b came after the first round's last call)
    (s1, e1, n1), (s2, e2, n2) = resumes(text)
    assert e1 == e2 == 0
    assert n1 == 2 * BATCH * s1  # steps 1..s1 with 2 nodes
    assert n2 == n1 + BATCH * (s2 - s1)  # steps s1+1..s2 with 1 node
    assert f"stop requested (SIGTERM) after step {s2}:" in text  # the SIGTERMed worker saved: no step lost
    last = snapshot_format.from_bytes((snaps / snapshot_format.snapshot_name(MAX_STEPS)).read_bytes(), "last")
    assert last["progress"]["step"] == MAX_STEPS and last["world_size"] == 2
    assert last["progress"]["epoch_samples"] == n2 + 2 * BATCH * (MAX_STEPS - s2)  # steps s2+1..MAX_STEPS, 2 nodes
    summary = read_summary(run_dir)
    assert summary["steps"] == MAX_STEPS and summary["world_size"] == 2 and summary["replicas_identical"]
    steps = {row["step"] for row in read_metrics(run_dir)}
    assert set(range(1, MAX_STEPS + 1)) <= steps


def rows_since_resume(run_dir, train_log: str) -> list[int]:
    """The steps of the training rows in metrics.jsonl since the one resume that train.log reports (none before it):
    from the last row of the step after the resumed one. Not where the step goes back: a node lost just after a
    snapshot leaves no row past it, and the resumed run's first row follows the last one (seen: resumed at step 8,
    rows 1-8 then 9-40, and the wait below timed out)."""
    resumed = resumes(train_log)
    if len(resumed) != 1:
        return []
    steps = [row["step"] for row in read_metrics(run_dir) if "train_loss" in row]
    first = [i for i, step in enumerate(steps) if step == resumed[0][0] + 1]
    return steps[first[-1] :] if first else []


def test_elastic_without_the_variable_stops_at_the_start_with_one_line(tmp_path):
    """torch 2.13 breaks a node's rejoin under the agents' shared store (see distributed.py): a --nnodes=MIN:MAX
    job without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is refused at once, not when a node comes back."""
    env = subprocess_env(tmp_path)  # without the variable
    agent = elastic_agent(tmp_path, "a", free_port(), True, env, max_restarts=0)
    try:
        code = agent.wait(timeout=120)
    finally:
        kill_agents(agent)
    log = (tmp_path / "a.log").read_text()
    errors = [line for line in log.splitlines() if "error: " in line and "torchrun --nnodes=1:2" in line]
    assert code != 0 and len(errors) == 1, log
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in errors[0], log
    assert 'main.py", line' not in log, log  # the worker's own traceback (torchrun's summary has one of its own)
    assert not (tmp_path / "snaps").exists() or not list((tmp_path / "snaps").iterdir())


def fake_worker(tmp_path, rank, port, agent_store, group_rank=None):
    """main.py as a torchrun worker would start it, with no peers: the meeting must end in one line."""
    env = {**subprocess_env(tmp_path), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
           "GROUP_RANK": str(rank if group_rank is None else group_rank), "MINGPT_MEET_TIMEOUT_S": "3"}
    return subprocess.run(
        cli(job_args(tmp_path / "snaps", tmp_path / "run")),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    "rank, agent_store, store, message",
    [
        # the agent's store (this test process hosts it, as node 0's agent would): rank 1 never answers
        (0, True, "ours", r"^error: the ranks did not meet within 3 s \(rank 0 heard nothing from rank 1 of 2\): "
                          r"torchrun \(torch .*\) can give .*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
        # rank 0's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): nothing listens there
        (1, False, None, r"^\[rank 1\] error: the ranks did not meet within 3 s \(nothing accepts connections at "
                         r"127\.0\.0\.1:\d+\): a rank did not start, or cannot reach rank 0's store"),
        # node 1's workers handed the store of their own agent (this test process): torch's stale store info
        (1, True, "ours", r"^\[rank 1\] error: torchrun gave the workers of node 1 the store of their own agent "
                          r"\(127\.0\.0\.1:\d+\).*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
    ],
)
def test_ranks_that_cannot_meet_stop_with_one_line(tmp_path, rank, agent_store, store, message):
    port = free_port()
    server = (dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30),
                            wait_for_workers=False) if store else None)
    started = datetime.datetime.now()
    proc = fake_worker(tmp_path, rank, port, agent_store)
    took = (datetime.datetime.now() - started).total_seconds()
    del server
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and re.match(message, lines[0]), proc.stderr
    assert took < 60
