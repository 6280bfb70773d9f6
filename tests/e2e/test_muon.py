"""Several optimizers in one run (mingpt.optim): the container, the schedules, Muon and AdamW side by side.

In-process: the groups Muon and AdamW get, the schedule as a factor of each group's own peak, Muon's momentum
warm-up, MeshMuon on plain tensors being torch's Muon bit for bit. One 2-process launch of tests/workers/muon_worker.py:
MeshMuon on sharded matrices against torch's Muon on the whole ones (and the negative control: torch's Muon on
the pieces). Muon under DDP and FSDP on 2 processes with a worker SIGKILLed and the job resumed bit for bit: the
kill-and-resume tests of tests/e2e/test_resume.py and tests/e2e/test_fsdp_ranks.py train with Muon where torch has it.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from support import (
    PROJECT_DIR,
    TINY,
    TORCHRUN,
    assert_one_error_line,
    muon_required,
    run_cli,
    subprocess_env,
)

needs_muon = muon_required()

@needs_muon
def test_mesh_muon_orthogonalises_whole_matrices_not_their_shards(tmp_path):
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2",
               str(PROJECT_DIR / "tests" / "workers" / "muon_worker.py"), str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    for split in ("rows", "columns"):
        weights, momentum = result[f"mesh_muon_{split}"]
        assert weights < 1e-6 and momentum < 1e-6, result  # torch's Muon on the whole matrix, to fp32 rounding
        assert result[f"torch_muon_on_pieces_{split}"][0] > 1e-4, result  # the fault the gathering avoids


@pytest.mark.oldest_torch
@pytest.mark.skipif(hasattr(torch.optim, "Muon"), reason="this torch has Muon (the tests above)")
def test_muon_is_refused_in_one_line_by_a_torch_without_it(tmp_path):
    refused = run_cli([*TINY, "optimizer_config.name=muon"], tmp_path)
    assert_one_error_line(refused, r"optimizer_config.name=muon \(torch.optim.Muon\) needs torch 2.9 or newer")
