"""Tensor parallelism (mingpt/parallel/tensor_parallel.py) in this process: the row permutation that gives each rank
the q, k and v rows of its own heads, and the conversions of full state dicts (weights and AdamW's moments) between
canonical and tensor-parallel order. TP between real torchrun processes, against one process:
tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
)
from tp_worker import (
    build,
    optimizer_of,
    tiny_config,
    train,
)

from mingpt.parallel.tensor_parallel import canonical_full, from_canonical, permuted_full, to_canonical

# ----------------------------------------------------------------------------------------------------------------
# In this process: the permutation and the state conversions of full tensors
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("degree", [1, 2, 4])
def test_permuted_rows_give_each_rank_the_q_k_v_of_its_own_heads(degree):
    width = 8
    weight = torch.arange(3 * width * 2, dtype=torch.float32).view(3 * width, 2)  # rows [q | k | v]
    bias = torch.arange(3 * width, dtype=torch.float32)
    for canonical in (weight, bias):
        q, k, v = canonical.chunk(3)
        shards = permuted_full(canonical, degree).chunk(degree)  # what Shard(0) hands each rank
        for rank, shard in enumerate(shards):
            own = [t.chunk(degree)[rank] for t in (q, k, v)]
            assert torch.equal(shard, torch.cat(own))
        assert torch.equal(canonical_full(permuted_full(canonical, degree), degree), canonical)


def test_full_state_dicts_convert_both_ways_and_only_the_permuted_rows():
    config = tiny_config(n_layer=1)
    model = build(config)
    optimizer = optimizer_of(model)
    train(model, optimizer, config, range(1), parallel_loss=False)  # moments to convert
    permuted = {f"transformer.h.0.attn.c_attn.{kind}": 2 for kind in ("weight", "bias")}
    canonical = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    laid_out = {key: from_canonical(state, None, permuted) for key, state in canonical.items()}  # TP 2's order
    for name in permuted:
        assert torch.equal(laid_out["model"][name], permuted_full(canonical["model"][name], 2))
        moments, expected = laid_out["optimizer"]["state"][name], canonical["optimizer"]["state"][name]
        assert torch.equal(moments["exp_avg_sq"], permuted_full(expected["exp_avg_sq"], 2))
        assert moments["step"] is expected["step"]  # 0-d: no rows
    assert laid_out["model"]["lm_head.weight"] is canonical["model"]["lm_head.weight"]  # not permuted: as it was
    assert laid_out["optimizer"]["param_groups"] is canonical["optimizer"]["param_groups"]
    back = {key: to_canonical(state, permuted) for key, state in laid_out.items()}
    assert all(torch.equal(back["model"][k], v) for k, v in canonical["model"].items())
    assert all(torch.equal(back["optimizer"]["state"][name][key], value)
               for name, entry in canonical["optimizer"]["state"].items() for key, value in entry.items())
