"""parallel_config.compile compiles training once and evaluation once, and nothing afterwards: every evaluation pass
has one shape (the last, smaller batch and the lockstep fillers are padded, their padding's targets ignored), so
no evaluation after the first recompiles. Counted with a backend that records each graph it is handed and runs it
as it is (Dynamo's guards and recompiles are the backend's business only in what it is handed)."""

from __future__ import annotations

import pytest
import torch
from support import make_trainer, reopen

from mingpt import compat
from mingpt.parallel import parallelize

pytestmark = pytest.mark.usefixtures("no_process_group_left")


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(
    compat.TORCH < compat.FSDP_TORCH, reason="FSDP needs torch 2.7"))])
def test_training_and_evaluation_compile_once_each(strategy, monkeypatch):
    graphs: list[tuple] = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        return graph.forward

    monkeypatch.setattr(parallelize, "compile_options", lambda device: {"backend": counting_backend})
    torch.compiler.reset()  # a fresh cache: graphs of another test's model are not this one's
    # 333 lines: the validation windows end in a smaller batch; 4 evaluations of every window
    trainer = reopen(lambda: make_trainer(strategy=strategy, compile=True, n_layer=2, lines=333, eval_batches=None,
                                          batch_size=4, max_steps=6, eval_every_steps=2, log_every_steps=2))
    evaluations = []
    validation_loss = trainer.validation_loss
    trainer.validation_loss = lambda: evaluations.append(len(graphs)) or validation_loss()
    trainer.fit()
    assert len(evaluations) == 3 and trainer.trained_steps == 6
    assert evaluations[0] == len(graphs) - 1  # training compiled before the first evaluation, which compiled once
    assert len(graphs) == 2, graphs  # the blocks of FSDP share one code object, compiled once for both
    batch = graphs[0][0][0] if strategy == "ddp" else graphs[0][1][0]  # (idx, ...) whole; (weight, x, ...) a block
    # evaluation: batches of 4 x batch_size windows, through the model batch_size windows at a time (in eval mode:
    # a graph of its own)
    assert batch == 4 and (graphs[1][0][0] if strategy == "ddp" else graphs[1][1][0]) == 4
