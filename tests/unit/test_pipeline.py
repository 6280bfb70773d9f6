"""Pipeline parallelism (mingpt/parallel/pipeline.py) in this process: how layers are split into stages and dealt to
ranks, and the stage modules keeping the GPT's names and chaining to its logits (tests/e2e/test_pipeline.py trains
them between real torchrun processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pp_worker import build
from reference import ALL_OPTIONS

from mingpt.errors import UsageError
from mingpt.parallel.pipeline import (
    GPTPipeline,
    GPTStage,
    rank_stages,
    stage_layers,
)

# ------------------------------------------------------------------------------------------------ in this process


def test_stage_layers_even_explicit_and_refused():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 2) == [range(0, 2), range(2, 5)]  # the later stage takes the extra block
    assert stage_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    assert stage_layers(1, 2) == [range(0, 0), range(0, 1)]  # the quick start's one block: embeddings alone first
    assert stage_layers(2, 3) == [range(0, 0), range(0, 1), range(1, 2)]
    refused = ((4, 2, [2, 1]), (4, 2, [4, 0]), (4, 3, [2, 2]), (2, 4, None), (3, 3, [1, 0, 2]))
    for n_layer, n_stages, explicit in refused:
        with pytest.raises(UsageError) as error:
            stage_layers(n_layer, n_stages, explicit)
        assert "\n" not in str(error.value)


def test_stages_are_dealt_round_robin():
    assert [rank_stages(rank, 2, 2) for rank in range(2)] == [[0, 2], [1, 3]]  # stage s on pipeline rank s % pp


def test_stages_keep_the_gpt_names_and_chain_to_its_logits():
    gpt = build()
    idx = torch.randint(65, (2, 32))
    expected = gpt(idx)[0]
    first, last = GPTStage(gpt, range(0, 2), True, False), GPTStage(gpt, range(2, 4), False, True)
    torch.testing.assert_close(last(first(idx)), expected, rtol=0, atol=0)
    whole = dict(gpt.named_parameters())
    for stage in (first, last):
        assert all(param is whole[name] for name, param in stage.named_parameters())
    assert next(iter(dict(last.named_parameters()))) == "transformer.wte.weight"  # the tied weight's GPT name
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(last.state_dict())
    assert set(first.state_dict()) | set(last.state_dict()) == set(gpt.state_dict())


def test_stages_of_a_rotary_untied_gpt_hold_their_own_parts_and_chain_to_its_logits():
    """No position embedding under rotary positions; an untied head is the last stage's alone (no wte there, so
    there is no tied copy to sum: tied_parameter is None on every stage)."""
    gpt = build(**ALL_OPTIONS)
    idx = torch.randint(65, (2, 32))
    first, last = GPTStage(gpt, range(0, 2), True, False), GPTStage(gpt, range(2, 4), False, True)
    torch.testing.assert_close(last(first(idx)), gpt(idx)[0], rtol=0, atol=0)
    assert "wpe" not in first.transformer and "wte" not in last.transformer
    assert set(first.state_dict()) | set(last.state_dict()) == set(gpt.state_dict())
    assert "lm_head.weight" in last.state_dict() and "transformer.wte.weight" in first.state_dict()
    for stages in ([first], [last]):
        assert GPTPipeline.tied_parameter(SimpleNamespace(stages=stages)) is None


