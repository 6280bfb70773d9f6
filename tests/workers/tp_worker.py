"""Run under torchrun by tests/e2e/test_tensor_parallel.py: tensor parallelism (mingpt/parallel/tensor_parallel.py)
between real processes, against one process training the same model on the same batches (reference.py): SGD steps
(reference.sgd) where weights after steps are compared, AdamW (fused, as a run's) where a state is saved and loaded.

    torchrun --standalone --nproc_per_node=2 tests/workers/tp_worker.py OUT_DIR [--compile]
    torchrun --standalone --nproc_per_node=4 tests/workers/tp_worker.py OUT_DIR

Two processes: "tp" (TP 2 against one process, and the same with the tie left undone), "dcp" (a TP 2 state saved in
canonical order; a one-process state loaded into TP 2, from DCP and from full tensors), "stages" (TP on two
pipeline-stage copies of the model), "error" (a degree that does not divide n_head, block_size or the sequence),
"options" (every model option of model.py at once: TP 2 against one process), and with --compile "compile" (bf16
autocast and torch.compile'd blocks; the backend: TP_COMPILE_BACKEND, inductor by default). Four processes:
"fsdp_tp" (FSDP2 over "dp" on top of TP over "tp", a 2x2 mesh; its state saved in canonical order, and loaded back).
Rank 0 writes OUT_DIR/result.json ({case: figures}, after each case) and the tensors the test process compares
against a checkpoint (OUT_DIR/*.pt). Every figure is computed on every rank (the collectives need them all); rank
0's are reported.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mingpt import startup  # noqa: E402

startup.pause_collection(__name__)  # as a run's command does (mingpt/startup.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from reference import ALL_OPTIONS, Reference, relative_difference, sgd  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from mingpt.errors import UsageError  # noqa: E402
from mingpt.optim import decay_groups  # noqa: E402
from mingpt.parallel.tensor_parallel import (  # noqa: E402
    apply_tensor_parallel,
    canonical_full,
    from_canonical,
    local_value,
    loss_parallel_context,
    to_canonical,
)
from model import GPT, GPTConfig  # noqa: E402

startup.resume_collection(__name__)

BATCH, STEPS = 4, 5
MAX_NORM = 0.05  # below every step's gradient norm here (the result reports them): clipping engages each step
LR, WEIGHT_DECAY = 1e-2, 0.1
FSDP_TP_CONFIG = dict(bias=False, n_layer=3)  # the 2x2 case's model: without biases, three blocks


def tiny_config(**overrides) -> GPTConfig:
    settings = dict(n_layer=2, n_head=4, n_embd=64, dropout=0.0, vocab_size=65, block_size=32, bias=True)
    return GPTConfig(**{**settings, **overrides})


def build(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW as a run builds it (fused): the optimizer of the cases that save and load its state."""
    return torch.optim.AdamW(decay_groups(model.named_parameters(), WEIGHT_DECAY), lr=LR, fused=True)


def batch(step: int, config: GPTConfig, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (the same on every rank), or its `rows` (a data-parallel rank's share)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(config.vocab_size, (BATCH, config.block_size + 1), generator=generator)
    return tokens[rows, :-1], tokens[rows, 1:]


def clip(model: nn.Module) -> float:
    """Clip by the total norm over every (DTensor) gradient; the norm of a DTensor is one too: gather its value."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    return norm.item()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor,
               parallel_loss: bool, amp: bool = False, permuted: Optional[dict[str, int]] = None,
               expected: Optional[dict[str, torch.Tensor]] = None) -> tuple[float, float, Optional[float]]:
    """One step: (loss, gradient norm before clipping, and with the reference's gradients of the step `expected`
    (collective) the largest relative difference of the gradients, whole and in canonical order, from them)."""
    optimizer.zero_grad(set_to_none=True)
    with loss_parallel_context(parallel_loss):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            _, loss = model(idx, targets)
        loss.backward()
    grad_diff = None
    if expected is not None:
        grads = full_state({name: p.grad for name, p in model.named_parameters()}, permuted or {})
        grad_diff = relative_difference(grads, expected)
    norm = clip(model)
    optimizer.step()
    return local_value(loss).item(), norm, grad_diff


def train(model: nn.Module, optimizer: torch.optim.Optimizer, config: GPTConfig, steps: range,
          parallel_loss: bool, rows: slice = slice(None), amp: bool = False, permuted: Optional[dict[str, int]] = None,
          expected: Optional[Reference] = None) -> dict[str, Any]:
    """`steps` steps of the global batches (these `rows`): losses, norms and, against the `expected` reference's
    gradients of the same steps (permuted: the rows to put back in canonical order), gradient_diff, the largest."""
    losses, norms, grad_diffs = [], [], []
    for index, step in enumerate(steps):
        loss, norm, grad_diff = train_step(model, optimizer, *batch(step, config, rows), parallel_loss, amp, permuted,
                                           None if expected is None else expected.gradients[index])
        losses.append(loss)
        norms.append(norm)
        grad_diffs.append(grad_diff)
    figures: dict[str, Any] = {"losses": losses, "norms": norms}
    if expected is not None:
        figures["gradient_diff"] = max(grad_diffs)
    return figures


def full_state(state: dict, permuted: dict[str, int]) -> dict[str, torch.Tensor]:
    """Collective. Every entry of a model state dict as a full tensor in canonical order, in sorted name order."""
    out = {}
    for name in sorted(state):
        value = state[name]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = (canonical_full(full, permuted[name]) if name in permuted else full).detach().clone()
    return out


def full_moments(optimizer_state: dict, permuted: dict[str, int]) -> dict[str, torch.Tensor]:
    """Collective. An optimizer state keyed by name -> {"name/exp_avg": full canonical tensor, ...}."""
    flat = {f"{name}/{key}": value for name, entry in optimizer_state["state"].items()
            for key, value in entry.items()}
    rows = {key: permuted[key.split("/")[0]] for key, value in flat.items()
            if key.split("/")[0] in permuted and value.dim() > 0}  # the moments, not the 0-d step
    return full_state(flat, rows)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference(config: GPTConfig, steps: range, optimizer: Callable[[nn.Module], torch.optim.Optimizer] = sgd,
              keep_gradients: bool = True) -> Reference:
    """One process: the plain GPT trained on the whole batches (every rank computes it alone, identically)."""
    model = build(config)
    return Reference(model, optimizer(model), MAX_NORM, keep_gradients=keep_gradients).train(
        batch(step, config) for step in steps)


def tensor_parallel_model(config: GPTConfig, mesh: DeviceMesh, seed: int = 0) -> tuple[GPT, dict[str, int]]:
    model = build(config, seed)
    return model, apply_tensor_parallel(model, mesh)


def gradients(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, parallel_loss: bool,
              permuted: dict[str, int]) -> dict[str, torch.Tensor]:
    """Collective. One forward and backward: each parameter's gradient, full and in canonical order; none kept."""
    with loss_parallel_context(parallel_loss):
        model(idx, targets)[1].backward()
    # Every name of a tied parameter: an untied copy's gradient then shows as a difference, not as a missing name.
    grads = full_state({name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}, permuted)
    model.zero_grad(set_to_none=True)
    return grads


def first_gradient_difference(model: nn.Module, permuted: dict[str, int], config: GPTConfig) -> float:
    """The largest difference between TP's and one process's gradients of the first batch (before AdamW, which
    magnifies differences in the tiny gradients it divides by their own size)."""
    expected = gradients(build(config), *batch(0, config), False, {})
    return max_difference(gradients(model, *batch(0, config), True, permuted), expected)


def untie(model: GPT) -> None:
    """What parallelize_module leaves when nothing re-ties: two separate copies of the shared matrix."""
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())


# ----------------------------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------------------------

def case_tp(mesh: DeviceMesh, out: Path) -> dict:
    """TP 2 against one process, 5 steps; the same with the tie undone, to show that the comparison would see it."""
    config = tiny_config()
    expected = reference(config, range(STEPS))
    expected_weights = expected.state()
    model, permuted = tensor_parallel_model(config, mesh)
    result = {"permuted": permuted, "tied": model.lm_head.weight is model.transformer.wte.weight,
              "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
              "first_gradient_max_difference": first_gradient_difference(model, permuted, config)}
    got = train(model, sgd(model), config, range(STEPS), parallel_loss=True, permuted=permuted, expected=expected)
    result.update(expected_losses=expected.losses, losses=got["losses"], norms=got["norms"],
                  gradient_diff=got["gradient_diff"], moved=expected.moved())
    result["max_weight_difference"] = max_difference(full_state(model.state_dict(), permuted), expected_weights)
    untied, permuted = tensor_parallel_model(config, mesh)
    untie(untied)
    train(untied, sgd(untied), config, range(STEPS), parallel_loss=True)
    state = {k: v for k, v in full_state(untied.state_dict(), permuted).items() if k != "lm_head.weight"}
    result["untied_max_weight_difference"] = max_difference(
        state, {k: v for k, v in expected_weights.items() if k != "lm_head.weight"})
    return result


def case_options(mesh: DeviceMesh, out: Path) -> dict:
    """Every model option at once against one process, 5 steps: rotary positions on each rank's heads, RMSNorm on
    sequence shards, q/k norm, ReLU squared, the soft cap on vocabulary-split logits, and an untied head split over
    the vocabulary on its own (nothing re-tied)."""
    config = tiny_config(**ALL_OPTIONS)
    unzeroed = tiny_config(**{**ALL_OPTIONS, "zero_init_proj": False})  # every gradient non-zero from the first
    expected = reference(config, range(STEPS))
    model, permuted = tensor_parallel_model(config, mesh)
    result = {"tied": model.lm_head.weight is model.transformer.wte.weight,
              "head_placements": str(model.lm_head.weight.placements),
              "norm": type(model.transformer.ln_f).__name__,
              "first_gradient_max_difference": first_gradient_difference(*tensor_parallel_model(unzeroed, mesh),
                                                                         unzeroed)}
    got = train(model, sgd(model), config, range(STEPS), parallel_loss=True, permuted=permuted, expected=expected)
    result.update(expected_losses=expected.losses, losses=got["losses"], gradient_diff=got["gradient_diff"],
                  moved=expected.moved())
    result["max_weight_difference"] = max_difference(full_state(model.state_dict(), permuted), expected.state())
    return result


def case_dcp(mesh: DeviceMesh, out: Path) -> dict:
    """TP 2 -> a checkpoint in canonical order (the test process loads it alone), and one process -> TP 2."""
    config = tiny_config()
    model, permuted = tensor_parallel_model(config, mesh)
    optimizer = optimizer_of(model)
    train(model, optimizer, config, range(STEPS), parallel_loss=True)
    started = time.perf_counter()
    dcp.save(canonical_checkpoint(model, optimizer, permuted), checkpoint_id=str(out / "tp_checkpoint"))
    result = {"save_seconds": time.perf_counter() - started}
    saved = {"weights": full_state(model.state_dict(), permuted),
             "moments": full_moments(get_optimizer_state_dict(model, optimizer), permuted)}
    train(model, optimizer, config, range(STEPS, STEPS + 1), parallel_loss=True)
    saved["next_weights"] = full_state(model.state_dict(), permuted)
    if dist.get_rank() == 0:
        torch.save(saved, out / "tp_checkpoint.pt")
    result.update(one_process_to_tp(config, mesh, out))
    return result


def canonical_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, permuted: dict[str, int]) -> dict:
    """Collective. What a snapshot saves: model and optimizer state (by name), permuted rows in canonical order."""
    return {"model": to_canonical(get_model_state_dict(model), permuted),
            "optimizer": to_canonical(get_optimizer_state_dict(model, optimizer), permuted)}


def load_canonical(model: nn.Module, optimizer: torch.optim.Optimizer, permuted: dict[str, int], folder: Path) -> None:
    """Collective. A canonical checkpoint into this (TP) model and optimizer: DCP loads into canonical copies of
    this process's own state, `from_canonical` puts them back into its layout."""
    own = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    canonical = {key: to_canonical(value, permuted) for key, value in own.items()}
    dcp.load(canonical, checkpoint_id=str(folder))
    set_model_state_dict(model, from_canonical(canonical["model"], own["model"], permuted))
    set_optimizer_state_dict(model, optimizer, from_canonical(canonical["optimizer"], own["optimizer"], permuted))


def one_process_to_tp(config: GPTConfig, mesh: DeviceMesh, out: Path) -> dict:
    """Rank 0 alone saves a one-process state (DCP, no process group); TP 2 loads it and takes the next step."""
    expected = reference(config, range(STEPS), optimizer_of, keep_gradients=False)
    expected_model, expected_optimizer = expected.model, expected.optimizer
    folder = out / "one_process_checkpoint"
    if dist.get_rank() == 0:
        state = {"model": get_model_state_dict(expected_model),
                 "optimizer": get_optimizer_state_dict(expected_model, expected_optimizer)}
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    dist.barrier()
    model, permuted = tensor_parallel_model(config, mesh, seed=1)  # other weights: the load must replace them all
    optimizer = optimizer_of(model)
    load_canonical(model, optimizer, permuted, folder)
    result = {
        "loaded_weights_equal": bitwise_equal(full_state(model.state_dict(), permuted),
                                              full_state(expected_model.state_dict(), {})),
        "loaded_moments_equal": bitwise_equal(
            full_moments(get_optimizer_state_dict(model, optimizer), permuted),
            full_moments(get_optimizer_state_dict(expected_model, expected_optimizer), {})),
        "still_tied": model.lm_head.weight is model.transformer.wte.weight,
        "loaded_full_weights_equal": full_tensors_load(config, mesh, expected_model),
    }
    train(model, optimizer, config, range(STEPS, STEPS + 1), parallel_loss=True)
    expected.step(*batch(STEPS, config))
    result["next_step_max_difference"] = max_difference(full_state(model.state_dict(), permuted),
                                                        full_state(expected_model.state_dict(), {}))
    return result


def full_tensors_load(config: GPTConfig, mesh: DeviceMesh, expected_model: GPT) -> bool:
    """A one-process model's own state_dict (full tensors, as a single-file snapshot holds) into TP 2."""
    model, permuted = tensor_parallel_model(config, mesh, seed=2)
    state = from_canonical(expected_model.state_dict(), None, permuted)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    return bitwise_equal(full_state(model.state_dict(), permuted), full_state(expected_model.state_dict(), {}))


def case_error(mesh: DeviceMesh, out: Path) -> dict:
    """Shapes the degree does not divide: n_head and block_size refused in one line before any collective; a
    shorter odd sequence refused before the collective that gloo would abort the process on."""
    result = {}
    for name, config in (("heads", tiny_config(n_head=1)), ("block_size", tiny_config(block_size=31))):
        try:
            apply_tensor_parallel(build(config), mesh)
            result[name] = None
        except UsageError as error:
            result[name] = str(error)
    model, _ = tensor_parallel_model(tiny_config(), mesh)
    try:
        model(batch(0, tiny_config())[0][:, :31])
        result["sequence"] = None
    except ValueError as error:
        result["sequence"] = str(error)
    return result


def case_compile(mesh: DeviceMesh, out: Path) -> dict:
    """bf16 autocast and torch.compile'd blocks under TP: a few steps against the eager fp32 ones."""
    config = tiny_config()
    model, _ = tensor_parallel_model(config, mesh)
    for block in model.transformer.h:
        block.compile(backend=os.environ.get("TP_COMPILE_BACKEND", "inductor"))
    started = time.perf_counter()
    got = train(model, optimizer_of(model), config, range(3), parallel_loss=True, amp=True)
    seconds = time.perf_counter() - started
    with torch.autocast("cpu", dtype=torch.bfloat16), loss_parallel_context(True):
        logits_dtype = str(model(batch(0, config)[0])[0].dtype)
    expected = reference(config, range(3), optimizer_of, keep_gradients=False)
    return {"losses": got["losses"], "expected_losses": expected.losses, "seconds": seconds,
            "logits_dtype": logits_dtype}


def case_fsdp_tp(mesh: DeviceMesh, out: Path) -> dict:
    """FSDP2 over "dp" on top of TP over "tp" (2x2), each data-parallel rank its half of the batch, against one
    process; its state saved in canonical order (the test process loads it alone) and loaded back on the mesh."""
    from torch.distributed.fsdp import fully_shard

    config = tiny_config(**FSDP_TP_CONFIG)
    expected = reference(config, range(STEPS))
    model, permuted = tensor_parallel_model(config, mesh["tp"])
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = sgd(model)
    half = BATCH // mesh["dp"].size()
    rows = slice(mesh["dp"].get_local_rank() * half, (mesh["dp"].get_local_rank() + 1) * half)
    got = train(model, optimizer, config, range(STEPS), parallel_loss=True, rows=rows, permuted=permuted,
                expected=expected)
    weights = full_state(model.state_dict(), permuted)
    losses = torch.tensor(got["losses"])  # each data-parallel rank's is that of its half: the mean is the batch's
    dist.all_reduce(losses, group=mesh["dp"].get_group())
    result = {"losses": (losses / mesh["dp"].size()).tolist(), "expected_losses": expected.losses,
              "norms": got["norms"], "placements": str(model.transformer.h[0].attn.c_attn.weight.placements),
              "gradient_diff": got["gradient_diff"], "moved": expected.moved(),
              "max_weight_difference": max_difference(weights, expected.state())}
    moments = full_moments(get_optimizer_state_dict(model, optimizer), permuted)
    dcp.save(canonical_checkpoint(model, optimizer, permuted), checkpoint_id=str(out / "fsdp_tp_checkpoint"))
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "moments": moments}, out / "fsdp_tp_checkpoint.pt")
    train(model, optimizer, config, range(STEPS, STEPS + 2), parallel_loss=True, rows=rows)  # move away from it
    load_canonical(model, optimizer, permuted, out / "fsdp_tp_checkpoint")
    result["reloaded_weights_equal"] = bitwise_equal(full_state(model.state_dict(), permuted), weights)
    result["reloaded_moments_equal"] = bitwise_equal(
        full_moments(get_optimizer_state_dict(model, optimizer), permuted), moments)
    return result


def stage_copies(config: GPTConfig) -> tuple[GPT, GPT]:
    """Two pipeline stages as a pipeline builds them: the whole model, less what the stage does not hold (blocks
    in a ModuleDict, so that the names stay)."""
    first, last = build(config), build(config)
    for stage in (first, last):
        stage.transformer.h = nn.ModuleDict({str(i): block for i, block in enumerate(stage.transformer.h)})
    del first.transformer["ln_f"], first.lm_head, first.transformer.h["1"]
    del last.transformer["wte"], last.transformer["wpe"], last.transformer.h["0"]
    return first, last


def stages_backward(first: GPT, last: GPT, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, list[int]]:
    """The two stages one after the other (what a pipeline schedule runs): the loss, and the shape handed on."""
    with loss_parallel_context(True):
        pos = torch.arange(idx.size(1))
        x = first.transformer.drop(first.transformer.wte(idx) + first.transformer.wpe(pos))
        x = first.transformer.h["0"](x)
        boundary = list(x.shape)  # what the first stage sends: its sequence shard, a plain tensor
        logits = last.lm_head(last.transformer.ln_f(last.transformer.h["1"](x)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
    return local_value(loss).item(), boundary


def case_stages(mesh: DeviceMesh, out: Path) -> dict:
    """TP on pipeline-stage copies (modules missing, blocks in a ModuleDict) against the whole model's gradients."""
    config = tiny_config()
    whole = build(config)
    _, loss = whole(*batch(0, config))
    loss.backward()
    first, last = stage_copies(config)
    permuted = {**apply_tensor_parallel(first, mesh), **apply_tensor_parallel(last, mesh)}
    got_loss, boundary = stages_backward(first, last, *batch(0, config))
    grads = full_state({name: p.grad for stage in (first, last) for name, p in stage.named_parameters()
                        if name != "lm_head.weight"}, permuted)
    head = last.lm_head.weight.grad.full_tensor()  # the tie spans the stages: the shared gradient is the sum
    grads["transformer.wte.weight"] = grads["transformer.wte.weight"] + head
    expected = {name: p.grad for name, p in whole.named_parameters()}
    return {"loss": got_loss, "expected_loss": loss.item(), "boundary_shape": boundary, "permuted": sorted(permuted),
            "max_gradient_difference": max_difference(grads, expected)}


CASES: dict[int, dict[str, Callable[[DeviceMesh, Path], dict]]] = {
    2: {"tp": case_tp, "options": case_options, "dcp": case_dcp, "stages": case_stages, "error": case_error},
    4: {"fsdp_tp": case_fsdp_tp},
}


def main() -> None:
    torch.set_num_threads(1)  # 2-4 processes on 2 cores
    out = Path(sys.argv[1])
    world = int(os.environ["WORLD_SIZE"])
    if world == 2:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = dict(CASES[world])
    if "--compile" in sys.argv[2:]:
        cases["compile"] = case_compile
    results = {}
    for name, case in cases.items():
        started = time.perf_counter()
        results[name] = case(mesh, out)
        results[name]["case_seconds"] = time.perf_counter() - started
        if dist.get_rank() == 0:  # after each case: a later one that fails leaves the earlier ones' figures
            (out / "result.json").write_text(json.dumps(results, indent=1))
    dist.barrier()  # before tearing down: a rank leaving early made gloo abort at exit (FINDINGS)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
