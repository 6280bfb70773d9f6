"""A one-node SLURM cluster on 127.0.0.1 for the tests: its own munged, slurmctld and slurmd, configured and kept
in a temporary folder, stopped (with every job) at the end. Needs root and Debian's slurmctld, slurmd and munge
packages (.ci/run installs them); `unavailable_reason()` says why a machine cannot run it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from support import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel")
REQUEUE_DELAY_S = 5  # how long a requeued job waits before it may start again (SLURM's default is 120 s)
JOB_CPU = min(os.sched_getaffinity(0))  # the one core the jobs run on (slurmd's, below)


def unavailable_reason() -> str | None:
    """Why this machine cannot run the test cluster, or None."""
    missing = [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing; apt-get install slurmctld slurmd munge)"
    if os.geteuid() != 0:
        return "the test cluster's slurmd must run as root"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """munged + slurmctld + slurmd in `root`, one node (this host, all its CPUs) in two partitions,
    `main` (the default) and `urgent`, whose jobs preempt those of `main`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """What a SLURM client command needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        self._write_config()
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(mode=0o700)
        key = munge_dir / "munge.key"  # the cluster's own key: nothing of the machine's munge is used or needed
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
                               f"--seed-file={munge_dir / 'munged.seed'}", f"--key-file={key}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-f", str(self.conf)])
        # slurmd on one core, and so every job (its step daemons inherit the CPUs it may run on; TaskPlugin=task/none
        # leaves them as they are): a job's two workers share that core, as on a node shared with other jobs, and
        # train 1.43 times slower on one core instead of two (tests/e2e/test_slurm.py sizes its runs by that).
        self._spawn("slurmd", [_binary("slurmd"), "-D", "-f", str(self.conf), "-N", self.node], cpus={JOB_CPU})
        self._wait(lambda: self.node_state() == "idle", timeout, f"node {self.node} to be idle")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (slurmd last: it ends the jobs' step daemons)."""
        if any(d.poll() is None for d in self.daemons):
            self.run("scancel", "--user=root", check=False)
            try:
                self._wait(lambda: not self.run("squeue", "--noheader", check=False).stdout.strip(), 40, "no jobs")
            except TimeoutError:
                pass
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()

    def run(self, command: str, *args: str, check: bool = True, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        proc = subprocess.run([_binary(command), *args], env={**os.environ, **(env or {}), **self.env}, cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{command} {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, *args: str, env: dict[str, str], cwd: Path) -> int:
        """Submit a batch job; returns its id."""
        return int(self.run("sbatch", "--parsable", *args, env=env, cwd=cwd).stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RunTime, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_job(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job is in one of `states`; returns its fields."""
        info: dict[str, str] = {}

        def in_state() -> bool:
            nonlocal info
            info = self.job(job_id)
            return info.get("JobState") in states

        self._wait(in_state, timeout, f"job {job_id} to be {'/'.join(sorted(states))} (now {info})", interval=0.5)
        return info

    def node_state(self) -> str:
        proc = self.run("sinfo", "--noheader", "--format=%T", "--nodes", self.node, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def _spawn(self, name: str, argv: list[str], cpus: set[int] | None = None) -> None:
        log = (self.root / f"{name}.out").open("w")
        pin = None if cpus is None else lambda: os.sched_setaffinity(0, cpus)
        self.daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=pin))

    def _wait(self, predicate, timeout: float, what: str, interval: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}: see {self.root}/*.out")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(interval)

    def _write_config(self) -> None:
        state = self.root / "state"
        state.mkdir(parents=True)
        lines = [
            "ClusterName=mingpt-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again
            f"AuthInfo=socket={self.munge_socket},cred_expire={REQUEUE_DELAY_S}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={state}/slurmd",
            f"SlurmctldPidFile={state}/slurmctld.pid",
            f"SlurmdPidFile={state}/slurmd.pid",
            f"SlurmctldLogFile={self.root}/slurmctld.log",
            f"SlurmdLogFile={self.root}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=1",  # a requeued job starts soon after its begin time
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobRequeue=1",
            "MinJobAge=600",  # finished jobs stay visible to scontrol for the whole test session
            # a job in partition "urgent" preempts (requeues) the jobs of "main", which get GraceTime to stop
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=main Nodes={self.node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30",
            f"PartitionName=urgent Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=2",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
