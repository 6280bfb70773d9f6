"""Run under torchrun by tests/e2e/test_pipeline.py: pipeline parallelism (mingpt/parallel/pipeline.py) between real
processes, against one process training the same GPT on the same global batches (reference.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/workers/pp_worker.py OUT_DIR
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tests/workers/pp_worker.py OUT_DIR

Every process first trains the reference (the whole GPT, one process's work) itself; each case then trains STEPS SGD
steps (reference.sgd: the weights after them are a well-conditioned function of the gradients) with clipping engaged
and compares per-step losses, gradient norms, gradients (before clipping and the optimizer) and final weights with it,
and evaluates (before training and mid-run) through the schedule's eval() (where pipeline.py uses it) and through the
pipeline's own forward pass. Two processes (PP 2): 1F1B, GPipe, Interleaved1F1B, uneven stages, and 1F1B with the
tied gradients left unsummed (must differ); an Interleaved1F1B state saved with torch.distributed.checkpoint and
resumed under 1F1B; evaluations of batches of several shapes; the one-line errors; 1F1B with every model option of
model.py on (rotary positions: no wpe on the first stage; an untied head: the last stage's own, no tied sum). Four
processes: PP 4 (1F1B, GPipe); PP 2 x FSDP2 2 (each schedule); PP 2 x DDP 2 (1F1B and GPipe, with
find_unused_parameters; plain DDP refused); PP 2 x FSDP2 replicas 2 (a 2-D mesh whose shard dimension is 1; each
schedule); and a PP 2 x FSDP 2 state saved with torch.distributed.checkpoint after 2 steps (OUT_DIR/dcp), with the
weights at the save and after the next step (OUT_DIR/next.pt) for loading into one process; gradients accumulated over
two steps with an evaluation between them against the same without. Rank 0 writes OUT_DIR/result.json. On torch 2.7
the cases pipeline.py refuses on a CPU there (1F1B, Interleaved1F1B) and FSDP2 replicas are left out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mingpt import startup  # noqa: E402

startup.pause_collection(__name__)  # as a run's command does (mingpt/startup.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from reference import ALL_OPTIONS, Reference, relative_difference, sgd  # noqa: E402

from mingpt.compat import TORCH  # noqa: E402
from mingpt.errors import UsageError  # noqa: E402
from mingpt.optim import Optimizers  # noqa: E402
from mingpt.parallel.pipeline import (  # noqa: E402
    SCHEDULE_EVAL_TORCH,
    GPTPipeline,
    build_pipeline,
    load_model_state_dict,
    model_state_dict,
)
from model import GPT, GPTConfig  # noqa: E402

startup.resume_collection(__name__)

BATCH, STEPS = 8, 5  # global batch (sequences); optimizer steps
EVAL_AT = (0, 3)  # evaluate before these steps: before any training (a mode switch first), and mid-run
MAX_NORM = 0.05  # below every step's gradient norm here (the result reports them): clipping engages each step
EVAL_STEP = 100  # the evaluation batch's seed


def tiny_config(**options: Any) -> GPTConfig:
    return GPTConfig(n_layer=4, n_head=4, n_embd=64, dropout=0.0, vocab_size=65, block_size=32, bias=True, **options)


def build(seed: int = 0, **options: Any) -> GPT:
    """The GPT of every case (with model `options` where given: GPTConfig fields)."""
    torch.manual_seed(seed)
    return GPT(tiny_config(**options))


def optimizer_of(module: nn.Module) -> torch.optim.Optimizer:
    """Every case's (and the reference's): weights after its steps are compared, so SGD (reference.py says why)."""
    return sgd(module)


def batch(step: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (the same on every rank), or its `rows` (a data-parallel rank's share)."""
    config = tiny_config()
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(config.vocab_size, (BATCH, config.block_size + 1), generator=generator)
    return tokens[rows, :-1], tokens[rows, 1:]


def reference(**options: Any) -> Reference:
    """The whole GPT (with model `options`) trained STEPS steps in this process; `evals`: its eval losses before the
    EVAL_AT steps."""
    model = build(**options)
    ref = Reference(model, optimizer_of(model), MAX_NORM)
    for step in range(STEPS):
        if step in EVAL_AT:
            ref.evaluate(*batch(EVAL_STEP))
        ref.step(*batch(step))
    return ref


# ------------------------------------------------------------------------------------------------------- helpers


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective over its mesh), or the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def world_mean(value: Optional[torch.Tensor], holders: int) -> float:
    """The mean over the `holders` ranks that have a value (the last stage's data-parallel ranks)."""
    total = torch.tensor(0.0 if value is None else value.item() / holders, dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def world_max(value: float) -> float:
    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total.item()


def weight_diff(pipe: GPTPipeline, ref: Reference) -> float:
    """Max |pipeline - reference| over every parameter of every rank (collective)."""
    weights = ref.parameters()
    diffs = [(full(p.detach()) - weights[name]).abs().max().item() for name, p in pipe.named_parameters()]
    return world_max(max(diffs))


def gradient_diff(pipe: GPTPipeline, expected: dict[str, torch.Tensor]) -> float:
    """The largest difference of a gradient of any rank (tied copies summed where the step summed them) from the
    reference's, relative to that gradient's largest entry (reference.relative_difference; collective)."""
    grads = {name: full(p.grad) if p.grad is not None else torch.zeros_like(expected[name])
             for name, p in pipe.named_parameters()}
    return world_max(relative_difference(grads, expected))


def state_keys(pipe: GPTPipeline) -> list[str]:
    """The union over ranks of the stages' state-dict keys (collective)."""
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted({key for stage in pipe.stages for key in stage.state_dict()}))
    return sorted(set().union(*keys))


def evaluate_both(pipe: GPTPipeline, rows: slice, holders: int) -> dict[str, Optional[float]]:
    """The eval loss through the schedule's eval() (None where pipeline.py does not use it) and through the own
    forward pass."""
    found: dict[str, Optional[float]] = {"schedule": None}
    paths = (("schedule", True), ("forward", False)) if TORCH >= SCHEDULE_EVAL_TORCH else (("forward", False),)
    for label, through_schedule in paths:
        pipe.evaluate_with_schedule = through_schedule
        found[label] = world_mean(pipe.evaluate(*batch(EVAL_STEP, rows)), holders)
    return found


# ------------------------------------------------------------------------------------------------------- cases


def train_step(pipe: GPTPipeline, optimizers: Optimizers, step: int, rows: slice, dp: int, sync: bool = True,
               expected: Optional[dict[str, torch.Tensor]] = None) -> tuple[float, float, Optional[float]]:
    """One optimizer step on this rank's rows of the global batch `step`: (the loss over every data-parallel rank,
    the gradient norm before clipping, and with the reference's gradients of the step `expected` the gradients'
    difference from them: gradient_diff)."""
    loss = pipe.step(*batch(step, rows))
    if sync:
        pipe.sync_tied_gradients()
    grad_diff = None if expected is None else gradient_diff(pipe, expected)
    norm = pipe.clip_grad_norm_(MAX_NORM).item()
    optimizers.step()
    optimizers.zero_grad()
    return world_mean(loss, dp), norm, grad_diff


def train(pipe: GPTPipeline, ref: Reference, dp: int, dp_rank: int, sync: bool = True) -> dict[str, Any]:
    """STEPS steps of the global batch (this data-parallel rank's rows), evaluated before the EVAL_AT steps; the
    figures (eval_diff: the largest difference from the reference over the evaluations, by path; gradient_diff: the
    largest over the steps)."""
    optimizers = Optimizers([(stage, optimizer_of(stage)) for stage in pipe.stages])
    per_rank = BATCH // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    losses, norms, grad_diffs, evals = [], [], [], []
    start = time.perf_counter()
    for step in range(STEPS):
        if step in EVAL_AT:
            evals.append(evaluate_both(pipe, rows, dp))
        loss, norm, grad_diff = train_step(pipe, optimizers, step, rows, dp, sync, ref.gradients[step])
        losses.append(loss)
        norms.append(norm)
        grad_diffs.append(grad_diff)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "losses": losses, "norms": norms,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref.losses)),
            "norm_diff": max(abs(a - b) for a, b in zip(norms, ref.norms)),
            "gradient_diff": max(grad_diffs),
            "weight_diff": weight_diff(pipe, ref),
            "eval_diff": {label: None if evals[0][label] is None else
                          max(abs(found[label] - expected) for found, expected in zip(evals, ref.evals))
                          for label in evals[0]},
            "keys_match": state_keys(pipe) == sorted(ref.model.state_dict())}


def offered(schedule: str) -> bool:
    """Whether pipeline.py runs `schedule` on a CPU with this torch (2.7: GPipe only)."""
    return TORCH >= (2, 8) or schedule == "GPipe"


def run_case(name: str, mesh: Any, dp: int, schedule: str, ref: Reference, results: dict[str, Any],
             prepare: Optional[Callable[[nn.Module], nn.Module]] = None, sync: bool = True,
             model: Optional[dict[str, Any]] = None, **options: Any) -> None:
    """Case `name`: the GPT (with `model` options; `ref` trained the same one) through build_pipeline(**options)."""
    if not offered(schedule):
        return
    dp_rank = mesh.get_local_rank("dp") if "dp" in mesh.mesh_dim_names else 0
    if "dp_replicate" in mesh.mesh_dim_names:
        dp_rank = mesh.get_local_rank("dp_replicate")
    pipe = build_pipeline(build(**(model or {})), mesh, torch.device("cpu"), schedule, prepare_stage=prepare,
                          **options)
    results[name] = train(pipe, ref, dp, dp_rank, sync)


def error_of(action: Callable[[], Any]) -> Optional[str]:
    try:
        action()
    except UsageError as error:
        return str(error)
    return None


def two_processes(ref: Reference, results: dict[str, Any], out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    run_case("pp_1f1b", mesh, 1, "1F1B", ref, results, microbatches=2)
    run_case("pp_gpipe", mesh, 1, "GPipe", ref, results, microbatches=4)
    run_case("pp_interleaved", mesh, 1, "Interleaved1F1B", ref, results, microbatches=4)
    run_case("pp_1f1b_uneven", mesh, 1, "1F1B", ref, results, microbatches=4, layers=[1, 3])
    run_case("pp_1f1b_untied", mesh, 1, "1F1B", ref, results, microbatches=2, sync=False)
    run_case("pp_1f1b_options", mesh, 1, "1F1B", reference(**ALL_OPTIONS), results, model=ALL_OPTIONS,
             microbatches=2)
    pipe = build_pipeline(build(), mesh, torch.device("cpu"), "GPipe", microbatches=4)
    results["resume"] = resume_elsewhere(mesh, ref, out)
    results["eval_shapes"] = evaluation_shapes(mesh)
    results["errors"] = {
        "microbatches": error_of(lambda: pipe.step(*batch(0, slice(0, 6)))),
        "interleaved_one_stage": error_of(lambda: build_pipeline(build(), mesh, torch.device("cpu"),
                                                                 "Interleaved1F1B", stages_per_rank=1)),
        "too_few_microbatches": error_of(lambda: build_pipeline(build(), mesh, torch.device("cpu"), "1F1B",
                                                                microbatches=1)),
    }


def evaluation_shapes(mesh: Any) -> dict[str, Any]:
    """PP 2 trained on batches of 8 evaluates batches of 8 (the schedule's eval()), 4, 6 (not a multiple of the 4
    micro-batches) and 8 again, then trains on; a batch of another shape for training is a one-line error."""
    schedule = "1F1B" if offered("1F1B") else "GPipe"
    pipe = build_pipeline(build(), mesh, torch.device("cpu"), schedule, microbatches=4)
    optimizers = Optimizers([(stage, optimizer_of(stage)) for stage in pipe.stages])
    model = build()
    ref = Reference(model, optimizer_of(model), MAX_NORM, keep_gradients=False)
    train_step(pipe, optimizers, 0, slice(None), 1)
    ref.step(*batch(0))
    diffs = []
    for rows in (slice(0, 8), slice(0, 4), slice(0, 6), slice(0, 8)):
        expected = ref.evaluate(*batch(EVAL_STEP, rows))
        diffs.append(abs(world_mean(pipe.evaluate(*batch(EVAL_STEP, rows)), 1) - expected))
    train_step(pipe, optimizers, 1, slice(None), 1)
    ref.step(*batch(1))
    return {"eval_diffs": diffs, "weight_diff": weight_diff(pipe, ref),
            "other_shape": error_of(lambda: pipe.step(*batch(2, slice(0, 4))))}


def shard(dp_mesh: Any) -> Callable[[nn.Module], nn.Module]:
    """FSDP2 on each block of the stage, then on the stage (as mingpt/parallel/parallelize.py shards a whole GPT)."""
    from torch.distributed.fsdp import fully_shard

    def prepare(stage: nn.Module) -> nn.Module:
        for block in stage.transformer.h.values():
            fully_shard(block, mesh=dp_mesh)
        return fully_shard(stage, mesh=dp_mesh)

    return prepare


def replicate_ddp(group: Any, **options: Any) -> Callable[[nn.Module], nn.Module]:
    from torch.nn.parallel import DistributedDataParallel

    return lambda stage: DistributedDataParallel(stage, process_group=group, **options)


def four_processes(ref: Reference, results: dict[str, Any], out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    deep = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))  # middle stages; the tie's own group (new_group)
    run_case("pp4_1f1b", deep, 1, "1F1B", ref, results, microbatches=4)
    run_case("pp4_gpipe", deep, 1, "GPipe", ref, results, microbatches=8)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    for name, schedule, microbatches in (("1f1b", "1F1B", 2), ("gpipe", "GPipe", 2),
                                         ("interleaved", "Interleaved1F1B", 4)):
        run_case(f"fsdp_{name}", mesh, 2, schedule, ref, results, shard(mesh["dp"]), microbatches=microbatches)
    ddp = replicate_ddp(mesh.get_group("dp"), find_unused_parameters=True)
    run_case("ddp_1f1b", mesh, 2, "1F1B", ref, results, ddp, microbatches=2)
    run_case("ddp_gpipe", mesh, 2, "GPipe", ref, results, ddp, microbatches=2)
    results["errors"] = {"ddp_plain": error_of(lambda: build_pipeline(
        build(), mesh, torch.device("cpu"), "GPipe", prepare_stage=replicate_ddp(mesh.get_group("dp"))))}
    hsdp = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    replicas = TORCH >= (2, 8)  # torch 2.7's FSDP2 all-reduces replicas with ReduceOp.AVG, which gloo lacks
    for name, schedule, microbatches in (("1f1b", "1F1B", 2), ("gpipe", "GPipe", 2),
                                         ("interleaved", "Interleaved1F1B", 4))[:3 if replicas else 0]:
        run_case(f"replicas_{name}", hsdp, 2, schedule, ref, results, shard(hsdp["dp_replicate", "dp_shard"]),
                 microbatches=microbatches)
    results["dcp"] = save_and_continue(mesh, out)
    results["eval_gradient_diff"] = evaluation_keeps_gradients(mesh)


def accumulated_gradients(mesh: Any, evaluate_between: bool) -> list[torch.Tensor]:
    """PP 2 x FSDP 2: the gradients of two batches accumulated, with or without an evaluation between them."""
    schedule = "1F1B" if offered("1F1B") else "GPipe"
    pipe = build_pipeline(build(), mesh, torch.device("cpu"), schedule, microbatches=2, prepare_stage=shard(mesh["dp"]))
    rows = slice(mesh.get_local_rank("dp") * BATCH // 2, (mesh.get_local_rank("dp") + 1) * BATCH // 2)
    pipe.step(*batch(0, rows))
    if evaluate_between:
        pipe.evaluate(*batch(EVAL_STEP, rows))
    pipe.step(*batch(1, rows))
    return [full(param.grad).clone() for param in pipe.parameters()]


def evaluation_keeps_gradients(mesh: Any) -> float:
    """Max difference an evaluation between accumulated steps makes to the gradients (collective)."""
    plain, evaluated = accumulated_gradients(mesh, False), accumulated_gradients(mesh, True)
    return world_max(max((a - b).abs().max().item() for a, b in zip(plain, evaluated)))


def gathered(pipe: GPTPipeline) -> dict[str, torch.Tensor]:
    """Every rank's full parameters, by name, on every rank (collective)."""
    mine = {name: full(p.detach()).clone() for name, p in pipe.named_parameters()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {name: tensor for part in parts for name, tensor in part.items()}


def save_and_continue(mesh: Any, out: Path) -> dict[str, Any]:
    """PP 2 x FSDP 2: 2 steps, a DCP save of model and optimizer by name, then one more step; rank 0 writes the
    weights at the save and after the next step, and that step's loss, for the test to match in one process."""
    import torch.distributed.checkpoint as dcp

    schedule = "1F1B" if offered("1F1B") else "GPipe"
    pipe = build_pipeline(build(), mesh, torch.device("cpu"), schedule, microbatches=2, prepare_stage=shard(mesh["dp"]))
    optimizers = Optimizers([(stage, optimizer_of(stage)) for stage in pipe.stages])
    rows = slice(mesh.get_local_rank("dp") * BATCH // 2, (mesh.get_local_rank("dp") + 1) * BATCH // 2)
    for step in range(2):
        train_step(pipe, optimizers, step, rows, 2)
    start = time.perf_counter()
    dcp.save(pipeline_state(pipe, optimizers), checkpoint_id=str(out / "dcp"))
    seconds = time.perf_counter() - start
    saved = gathered(pipe)
    loss, _, _ = train_step(pipe, optimizers, 2, rows, 2)
    after = gathered(pipe)
    if dist.get_rank() == 0:
        torch.save({"saved": saved, "after": after, "loss": loss}, out / "next.pt")
    return {"save_seconds": round(seconds, 3)}


# The stages' optimizers as one dict in torch's flattened form (keyed by parameter name, made for pipelines), which
# DCP saves and loads here without the trainer: this worker checks the schedules, the trainer's snapshots go
# through OptimizerState.
def _flattened() -> Any:
    """Optimizer state keyed `state.<param name>.<field>` and `param_groups.<param name>.<setting>`: merges over
    stages and loads into any layout by name (torch made the flat form for pipelines)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state_dict(pipe: GPTPipeline, optimizers: Optimizers) -> dict[str, Any]:
    """This rank's optimizers' state, merged over its stages, in the flat form keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    merged: dict[str, Any] = {}
    for stage, optimizer in zip(pipe.stages, optimizers.optimizers):
        merged.update(get_optimizer_state_dict(stage, optimizer, options=_flattened()))
    return merged


def load_optimizer_state_dict(pipe: GPTPipeline, optimizers: Optimizers, state: dict[str, Any]) -> None:
    """Each stage's optimizer takes the entries of its parameters from a flat state keyed by name (others unread)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for stage, optimizer in zip(pipe.stages, optimizers.optimizers):
        set_optimizer_state_dict(stage, optimizer, state, options=_flattened())


def pipeline_state(pipe: GPTPipeline, optimizers: Optimizers) -> dict[str, Any]:
    """What a snapshot holds: the stages' model and optimizer states, by the whole GPT's names."""
    return {"model": model_state_dict(pipe), "optimizer": optimizer_state_dict(pipe, optimizers)}


def resume_elsewhere(mesh: Any, ref: Reference, out: Path) -> Optional[dict[str, Any]]:
    """PP 2: 2 steps under Interleaved1F1B (two stages, two optimizers per rank), saved with DCP; loaded into a
    1F1B pipeline built from other weights (one stage per rank), which trains the remaining steps. Its losses and
    final weights against the reference."""
    import torch.distributed.checkpoint as dcp

    if not offered("Interleaved1F1B"):
        return None
    first = build_pipeline(build(), mesh, torch.device("cpu"), "Interleaved1F1B", microbatches=4)
    optimizers = Optimizers([(stage, optimizer_of(stage)) for stage in first.stages])
    for step in range(2):
        train_step(first, optimizers, step, slice(None), 1)
    dcp.save(pipeline_state(first, optimizers), checkpoint_id=str(out / "dcp_interleaved"))
    second = build_pipeline(build(seed=1), mesh, torch.device("cpu"), "1F1B", microbatches=2)
    optimizers = Optimizers([(stage, optimizer_of(stage)) for stage in second.stages])
    state = pipeline_state(second, optimizers)
    dcp.load(state, checkpoint_id=str(out / "dcp_interleaved"))
    load_model_state_dict(second, state["model"])
    load_optimizer_state_dict(second, optimizers, state["optimizer"])
    figures = [train_step(second, optimizers, step, slice(None), 1, expected=ref.gradients[step])
               for step in range(2, STEPS)]
    return {"loss_diff": max(abs(loss - expected) for (loss, _, _), expected in zip(figures, ref.losses[2:])),
            "gradient_diff": max(grad_diff for _, _, grad_diff in figures),
            "weight_diff": weight_diff(second, ref)}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict[str, Any] = {"torch": torch.__version__}
    start = time.perf_counter()
    ref = reference()
    results["reference_seconds"] = round(time.perf_counter() - start, 2)
    if dist.get_world_size() == 2:
        two_processes(ref, results, out)
    else:
        four_processes(ref, results, out)
    results["reference"] = {"losses": ref.losses, "norms": ref.norms, "evals": ref.evals, "moved": ref.moved()}
    dist.barrier()  # before destroying the group: avoids gloo's "terminate called without an active exception"
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
