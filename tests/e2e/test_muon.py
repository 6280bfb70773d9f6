"""Muon through the real CLI: a torch without torch.optim.Muon refuses optimizer_config.name=muon in one line. In this
process (the groups, the schedules, MeshMuon on plain tensors): tests/unit/test_muon.py. MeshMuon on sharded
matrices between torchrun processes, and FSDP, TP and PP trained with Muon: the 2-process launch of
tests/e2e/test_layouts.py. Muon under DDP and FSDP on 2 processes with a worker SIGKILLed and the job resumed bit for
bit: the kill-and-resume tests of tests/e2e/test_resume.py and tests/e2e/test_fsdp_ranks.py train with Muon where
torch has it.
"""

from __future__ import annotations

import pytest
import torch
from support import TINY, assert_one_error_line, run_cli


@pytest.mark.oldest_torch
@pytest.mark.skipif(hasattr(torch.optim, "Muon"), reason="this torch has Muon (tests/unit/test_muon.py)")
def test_muon_is_refused_in_one_line_by_a_torch_without_it(tmp_path):
    refused = run_cli([*TINY, "optimizer_config.name=muon"], tmp_path)
    assert_one_error_line(refused, r"optimizer_config.name=muon \(torch.optim.Muon\) needs torch 2.9 or newer")
