"""Layouts on one device mesh (mingpt/parallel/layout.py), in this process: how parallel_config's degrees resolve for
a world size (the unset ones take the rest), and the untested products refused in one line. Every layout trained
through the real Trainer between torchrun processes, and the survey's hybrid example through the CLI:
tests/e2e/test_layouts.py; the layouts the CLI refuses: tests/e2e/test_bad_input.py."""

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
