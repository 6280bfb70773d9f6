"""The fork server (forkserver.py), with real processes: a stand-in agent (tests/fake_agent.py) starts main.py
workers as torchrun does, and one server serves all the checks of this module (its warm-up is paid once).

A served worker must be indistinguishable from a fresh process: the same weights to the bit, the same output and
exit codes, signals passed on, a SIGKILLed worker taking its child along, a stopped worker stopping it. The server
must refuse what a fork would get wrong (another environment, changed code) and leave with its agent. The restarts
of real torchrun jobs through the server are tested in test_restarts.py, test_resume.py and the others."""

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Optional

import pytest
from support import (
    PYTHON,
    TINY,
    children,
    cli,
    fork_servers,
    free_port,
    logged_step,
    read_summary,
    run_cli,
    subprocess_env,
    wait_for,
)

from mingpt import PROJECT_DIR
from mingpt.distributed import forkserver


class Agent:
    """tests/fake_agent.py, and the environment its workers share (what may differ: torchrun's per-worker set)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = {**subprocess_env(folder), forkserver.SWITCH: "1",  # the opt-in
                    "TORCHELASTIC_RUN_ID": f"test-{uuid.uuid4().hex[:8]}", "TORCHELASTIC_RESTART_COUNT": "0",
                    "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                    "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        self.process = subprocess.Popen([PYTHON, str(Path(__file__).parent / "fake_agent.py")], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.pid = self.process.pid
        self.logs = 0

    def _ask(self, order: dict) -> dict:
        self.process.stdin.write(json.dumps(order) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def start(self, args: list[str], cpus: Optional[set[int]] = None, **env: str) -> tuple[int, Path]:
        """A worker `python -u main.py ARGS` (torchrun's command line), bound to `cpus` if given: its pid and its
        output's file."""
        self.logs += 1
        log = self.folder / f"worker{self.logs}.log"
        worker_env = {**self.env, "MASTER_PORT": str(free_port()), **env}
        order = {"start": [PYTHON, "-u", *cli(args)[1:]], "env": worker_env, "log": str(log),
                 "cpus": sorted(cpus) if cpus else None}
        return self._ask(order)["pid"], log

    def wait(self, pid: int) -> int:
        return self._ask({"wait": pid})["code"]

    def run(self, args: list[str], **env: str) -> tuple[int, str]:
        pid, log = self.start(args, **env)
        return self.wait(pid), log.read_text()

    def server(self) -> int:
        """The pid of this agent's fork server (0: none)."""
        return next(iter(fork_servers(self.pid)), 0)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent")
    agent = Agent(folder)
    yield agent
    agent.process.stdin.close()
    agent.process.wait(timeout=30)
    wait_for(lambda: not agent.server(), timeout=15, what="the fork server to leave with its agent")


def train_args(folder: Path, name: str, steps: int) -> list[str]:
    return [*TINY, f"trainer_config.max_steps={steps}", f"trainer_config.snapshot_path={folder / name / 'snaps'}",
            f"hydra.run.dir={folder / name / 'run'}", "trainer_config.progress=lines"]


def summary(folder: Path, name: str) -> dict:
    return read_summary(folder / name / "run")


def test_a_served_worker_trains_and_reports_as_a_fresh_process(agent, tmp_path):
    code, output = agent.run(train_args(tmp_path, "served", 20))
    assert code == 0, output[-3000:]
    server = agent.server()
    assert server, "no fork server started"
    plain = run_cli(train_args(tmp_path, "plain", 20), tmp_path)  # python main.py, no torchrun: no server
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert summary(tmp_path, "served")["weights_sha256"] == summary(tmp_path, "plain")["weights_sha256"]
    assert "forkserver" not in output and "Traceback" not in output

    # A mistake: the same one line and exit code as a fresh process's, from the same server.
    code, output = agent.run([*TINY, "gpt_config.n_layr=3"])
    plain = run_cli([*TINY, "gpt_config.n_layr=3"], tmp_path)
    assert (code, output.strip()) == (plain.returncode, plain.stderr.strip()) and code == 2, output
    assert agent.server() == server


def test_signals_reach_the_child_and_its_end_is_the_workers(agent, tmp_path):
    # Each child keeps its worker's CPU binding (torchrun --numa-binding binds each local rank to its own CPUs).
    allowed = sorted(os.sched_getaffinity(0))
    first, last = {allowed[0]}, {allowed[-1]}

    # SIGTERM to the worker: the child stops after its step with a snapshot and exits 0, as a fresh process does.
    worker, log = agent.start(train_args(tmp_path, "term", 100000), cpus=last)
    wait_for(lambda: logged_step(tmp_path / "term" / "run") >= 10, timeout=120, what="step 10")
    (child,) = children(agent.server())
    assert os.sched_getaffinity(child) == last
    os.kill(worker, signal.SIGTERM)
    assert agent.wait(worker) == 0, log.read_text()[-3000:]
    assert "stop requested (SIGTERM)" in log.read_text()
    assert list((tmp_path / "term" / "snaps").glob("snapshot-*.pt"))

    # SIGSTOP cannot be passed on: the child follows its stopped worker, and its SIGCONT.
    worker, log = agent.start(train_args(tmp_path, "stop", 100000), cpus=first)
    wait_for(lambda: logged_step(tmp_path / "stop" / "run") >= 10, timeout=120, what="step 10")
    (child,) = children(agent.server())
    assert os.sched_getaffinity(child) == first
    os.kill(worker, signal.SIGSTOP)
    wait_for(lambda: forkserver.process_state(child) == "T", timeout=5, what="the child to stop")
    os.kill(worker, signal.SIGCONT)
    wait_for(lambda: forkserver.process_state(child) not in ("T", ""), timeout=5, what="the child to go on")

    # A SIGKILLed worker takes its child along (torchrun then starts a new one), a stopped child too (the server).
    os.kill(worker, signal.SIGSTOP)
    wait_for(lambda: forkserver.process_state(child) == "T", timeout=5, what="the child to stop again")
    os.kill(worker, signal.SIGKILL)
    assert agent.wait(worker) == -signal.SIGKILL
    wait_for(lambda: not forkserver.process_state(child), timeout=5, what="the child to die with its worker")

    # A child that dies by a signal: its worker ends by the same signal, for torchrun to see.
    worker, log = agent.start(train_args(tmp_path, "oom", 100000))
    wait_for(lambda: logged_step(tmp_path / "oom" / "run") >= 5, timeout=120, what="step 5")
    (child,) = children(agent.server())
    os.kill(child, signal.SIGKILL)  # as the OOM killer would
    assert agent.wait(worker) == -signal.SIGKILL


def test_what_a_fork_would_get_wrong_is_refused_and_started_as_usual(agent, tmp_path):
    args = ["--help"]
    code, output = agent.run(args, MINGPT_TEST_SETTING="1")  # read at import time, for all the server knows
    assert code == 0 and "MINGPT_TEST_SETTING" in output and "this worker starts on its own" in output, output
    assert output.count("forkserver:") == 1 and "trainer_config" in output

    server = agent.server()
    source = PROJECT_DIR / "mingpt" / "errors.py"
    stamp = source.stat()
    try:
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # as an edit between restarts
        code, output = agent.run(args)
    finally:
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert code == 0 and "code changed since the fork server started (errors.py)" in output, output
    wait_for(lambda: agent.server() != server, timeout=15, what="the stale server to leave")
    code, output = agent.run(args)  # a new server, with the code as it is now
    assert code == 0 and "forkserver:" not in output, output
    assert agent.server() not in (0, server)


def test_used_under_torchrun_only_when_switched_on():
    def applies(**env: str) -> str:
        check = subprocess.run([PYTHON, "-c", "from mingpt.distributed import forkserver as f; print(f._applies())"],
                               cwd=PROJECT_DIR,
                               env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
        return check.stdout.strip()

    assert not forkserver._applies()  # this process: not a torchrun worker (no TORCHELASTIC_RUN_ID)
    assert applies(TORCHELASTIC_RUN_ID="x") == "False"  # the default: torchrun's own workers
    assert applies(TORCHELASTIC_RUN_ID="x", MINGPT_FORKSERVER="0") == "False"
    assert applies(TORCHELASTIC_RUN_ID="x", MINGPT_FORKSERVER="1") == "True"
    assert applies(MINGPT_FORKSERVER="1") == "False"  # not under torchrun


@pytest.mark.parametrize("library, loaded", [("libcuda.so.1", True), ("libcuda.so.580.159.04", True),
                                             ("libnvidia-ml.so.1", False), ("libcudart.so.12", False)])
def test_a_server_whose_cuda_driver_is_loaded_refuses(tmp_path, library, loaded):
    """A driver initialised while the server imported (an NVML fallback in device_count() calls cuInit without
    setting torch.cuda.is_initialized()) would make every fork unusable for CUDA: the driver's library in the
    server's memory map is the sign; the runtime (cudart) and NVML alone are not."""
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 fd:01 42  /usr/lib/python3.12/lib-dynload/_ssl.so\n"
                    f"7f0000002000-7f0000003000 r-xp 00000000 fd:01 43  /usr/lib/x86_64-linux-gnu/{library}\n")
    assert forkserver.cuda_driver_loaded(str(maps)) is loaded
    assert forkserver.cuda_driver_loaded() is False  # this process: no CUDA driver on this machine


def test_a_stop_under_way_outlives_more_sigterms():
    """A dying torchrun agent's PR_SET_PDEATHSIG comes once per thread of the agent: the worker, and so its fork, may
    get SIGTERM again after it agreed to stop; that must not end it while it writes its snapshot."""
    code = """if True:
        import os, signal, time, torch
        from mingpt.distributed.stopping import StopRequest
        stop = StopRequest(0, torch.device("cpu"), None, 5.0, lambda: None)
        with stop.watch():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        print("still here")"""
    result = subprocess.run([PYTHON, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "still here"), result.stderr[-2000:]
