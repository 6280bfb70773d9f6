"""Tensor, pipeline and hybrid layouts on one device mesh, through the real Trainer and the real CLI (torchrun, gloo).

Two launches of tests/workers/layout_worker.py (2 and 4 processes) check every supported layout three ways: 6 steps end
with the weights one process reaches on the same global batches (fp32, dropout 0, clipping engaged; the tolerance,
1e-4, is far below what a real fault gives: untied embeddings 4.5e-2, an unpermuted q/k/v 0.16, a pipeline's tied
gradient left unsummed, tests/e2e/test_pipeline.py); a run resumed from its step-3 snapshot ends bit-for-bit equal; and
the snapshot loads bit-for-bit into the next layout of the list. The 2-process launch also trains DDP, FSDP, TP
and PP with Muon (tolerance: MUON_TOLERANCE). Then the survey's hybrid example through the CLI:
2 pipeline stages x 2 replicas on 4 processes, a worker SIGKILLed, the job resumed by torchrun to the uninterrupted
run's weights, its snapshot resumed by one process and by FSDP on 2. Refused settings: one line each."""

from __future__ import annotations

import pytest

from mingpt.errors import UsageError
from mingpt.parallel.layout import Layout, ParallelConfig, resolve_layout


def test_the_degrees_take_the_rest_and_untested_products_are_refused():
    # on a mesh, FSDP2 makes the replicas too: its strategy is fsdp whatever parallel_config.strategy says
    assert resolve_layout(ParallelConfig(pp=2), 4) == Layout(pp=2, dp_replicate=2, strategy="fsdp")
    assert resolve_layout(ParallelConfig(strategy="fsdp", tp=2), 8) == Layout(dp_shard=4, tp=2, strategy="fsdp")
    assert resolve_layout(ParallelConfig(strategy="fsdp", dp_replicate=2), 8) == Layout(dp_replicate=2, dp_shard=4,
                                                                                     strategy="fsdp")
    assert resolve_layout(ParallelConfig(dp_shard=2), 8) == Layout(dp_replicate=4, dp_shard=2, strategy="fsdp")
    plain = resolve_layout(ParallelConfig(), 4)
    assert plain == Layout(dp_replicate=4) and not plain.needs_mesh and plain.name == "ddp"
    assert resolve_layout(ParallelConfig(strategy="fsdp"), 1).name == "fsdp"  # one process, one shard
    for cfg, world in ((ParallelConfig(tp=3), 4), (ParallelConfig(pp=2, tp=2), 8),
                       (ParallelConfig(dp_replicate=2, dp_shard=2), 8)):
        with pytest.raises(UsageError) as error:
            resolve_layout(cfg, world)
        assert "\n" not in str(error.value)
