"""Train a GPT with DistributedDataParallel: the Hydra entry point, its config schema and the wiring.

    torchrun --standalone --nproc_per_node=4 main.py                       # a 4-GPU node
    torchrun --standalone --nproc_per_node=2 main.py preset=cpu            # a CPU machine, 2 processes
    python main.py preset=cpu trainer_config.max_steps=200                 # one process, no torchrun
    python main.py gpt_config.n_layer=4 trainer_config.max_epochs=20       # any setting, Hydra style

Steps: compose gpt2_train_cfg.yaml with the overrides (checked against TrainConfig, the schema below, before any
process group exists) -> read the text -> set up the process group -> build GPT, spread it over the processes as
parallel_config lays them out (with its optimizers) -> Trainer.fit().
"""

from __future__ import annotations

from mingpt import startup
from mingpt.distributed.orphans import exit_with_parent

# Before the imports below: under torchrun, die with the agent (torch alone takes seconds to import, and the agent
# may die meanwhile); and import without the garbage collector walking what the imports make (mingpt/startup.py).
exit_with_parent()
startup.pause_collection(__name__)

import dataclasses
import functools
import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from char_dataset import CharCorpus, DataConfig
from mingpt import config
from mingpt.checkpoint.hf_import import Gpt2Folder, gpt2_state_dict, read_gpt2_folder
from mingpt.checkpoint.store import SnapshotStore, describe_nonfinite, nonfinite_tensors, tokenizer_fields
from mingpt.compat import check_torch_supported
from mingpt.config import CONFIG_NAME, redacted, scrub_hydra_output, sweep_job_name, to_dataclasses
from mingpt.data.tokenizer import tokenizer_file
from mingpt.distributed.process_group import (
    DistContext,
    abandon_distributed,
    check_launch_environment,
    configure_device,
    global_rank,
    leave_distributed,
    local_rank,
    on_abrupt_exit,
    report_failure,
    setup_distributed,
    world_size,
)
from mingpt.distributed.stopping import exit_now
from mingpt.errors import UsageError, describe
from mingpt.optim import OptimizerConfig, build_optimizer, check_optimizer_fits, lr_factor
from mingpt.parallel.layout import ParallelConfig, writes_shards
from mingpt.parallel.materialize import InitialValue
from mingpt.parallel.parallelize import builds_on_meta, parallelize
from mingpt.reporting.logs import setup_logging
from mingpt.reporting.plot import LossPlotter
from mingpt.reporting.trackers import Tracking, TrackingConfig
from mingpt.storage.locations import resolve_path
from model import GPT, GPTConfig
from sample import generate_text, one_core_spared
from trainer import Trainer, TrainerConfig, resolve_attention, resolve_precision

startup.resume_collection(__name__)
log = logging.getLogger("mingpt")


# ------------------------------------------------------------------------------------------------------- the config
@dataclass
class ModelSettings(GPTConfig):
    """gpt_config: the model (model.GPTConfig) and where a run's starting weights come from, which the model itself
    never knows (a folder is the config layer's business)."""

    init_from: Optional[str] = None
    """a Hugging Face GPT-2 folder (config.json, model.safetensors, tokenizer.json) to start from; null = random init

    The folder gives the shape, the options and the tokenizer (mingpt/checkpoint/hf_import.py), and its weights are
    the starting point of a fresh run; a snapshot to resume wins over them (docs/finetuning.md)."""

    def model(self) -> GPTConfig:
        """The model's own config: these settings without init_from."""
        return GPTConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)})


@dataclass
class TrainConfig:
    """The whole job; each section goes to the component that owns it."""

    data_config: DataConfig = field(default_factory=DataConfig)
    gpt_config: ModelSettings = field(default_factory=ModelSettings)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer_config: TrainerConfig = field(default_factory=TrainerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    tracking_config: TrackingConfig = field(default_factory=TrackingConfig)

    # Keys that moved to another section: one line naming the new place (mingpt.config.moved_key_error)
    moved_keys: ClassVar[dict[str, str]] = {f"trainer_config.{key}": f"parallel_config.{key}"
                                            for key in ("strategy", "compile", "activation_checkpointing")}

    def __post_init__(self) -> None:
        """What no section can check alone."""
        for derived in ("vocab_size", "block_size"):
            if getattr(self.gpt_config, derived) is not None:
                raise UsageError(f"gpt_config.{derived} is set from the data; leave it null")
        self.parallel_config.check_fits(self.gpt_config.n_head, self.gpt_config.n_layer, self.data_config.block_size,
                                        self.trainer_config.batch_size, self.trainer_config.mixed_precision)


def load_config(overrides: list[str]) -> TrainConfig:
    """gpt2_train_cfg.yaml with these overrides, validated: what a tool other than training reads (bench.py)."""
    return config.compose_config(TrainConfig, overrides)


# ------------------------------------------------------------------------------------------------------- the start
def overridden_keys(overrides: Sequence[str]) -> set[str]:
    """The keys the command line sets (`gpt_config.n_layer=4`, `+x.y=1`, a sweep's `a.b=1,2`), not a preset's."""
    return {override.lstrip("+~").partition("=")[0] for override in overrides}


def as_setting(value: Any) -> str:
    """A value as the command line writes it (true, null, 4)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def from_folder(cfg: TrainConfig, overrides: Sequence[str]) -> tuple[TrainConfig, Optional[Gpt2Folder]]:
    """gpt_config.init_from read (config.json) and made the run's settings: the folder's shape and options replace
    gpt_config's (the YAML's and a preset's), its tokenizer.json is data_config.tokenizer. A command-line override
    that contradicts the folder, another tokenizer, or windows longer than its n_positions: a UsageError."""
    if not cfg.gpt_config.init_from:
        return cfg, None
    folder = read_gpt2_folder(cfg.gpt_config.init_from)
    source = f"gpt_config.init_from={cfg.gpt_config.init_from}"
    explicit = overridden_keys(overrides)
    for name, value in folder.options.items():
        given = getattr(cfg.gpt_config, name)
        if f"gpt_config.{name}" in explicit and given != value:
            raise UsageError(f"gpt_config.{name}={as_setting(given)} contradicts {source}, whose config.json "
                             f"gives {name}={as_setting(value)}: leave it out, the folder sets the model")
    if "data_config.tokenizer" in explicit and (
            cfg.data_config.tokenizer in ("char", "bpe")
            or tokenizer_file(cfg.data_config.tokenizer).read_bytes() != folder.tokenizer.read_bytes()):
        raise UsageError(f"data_config.tokenizer={cfg.data_config.tokenizer}: a run from {source} uses the folder's "
                         f"own tokenizer ({folder.tokenizer}); leave data_config.tokenizer out")
    if cfg.data_config.block_size > folder.n_positions:
        raise UsageError(f"data_config.block_size={cfg.data_config.block_size} is longer than the n_positions of "
                         f"{source} ({folder.n_positions}): set data_config.block_size={folder.n_positions} or less")
    gpt_config = dataclasses.replace(cfg.gpt_config, **folder.options)
    data_config = dataclasses.replace(cfg.data_config, tokenizer=str(folder.tokenizer))
    return dataclasses.replace(cfg, gpt_config=gpt_config, data_config=data_config), folder


def starting_weights(cfg: TrainConfig, corpus: CharCorpus, folder: Gpt2Folder) -> dict[str, torch.Tensor]:
    """The folder's weights under our names, checked against the model its config.json describes (every tensor,
    its shape, finite) and its vocabulary against the corpus's tokenizer: before any process group."""
    if corpus.tokenizer.size > folder.vocab_size:
        raise UsageError(f"gpt_config.init_from={cfg.gpt_config.init_from}: its tokenizer has "
                         f"{corpus.tokenizer.size:,} tokens, more than the "
                         f"{folder.vocab_size:,} rows of its model's embedding")
    with torch.device("meta"):  # the shapes only
        shapes = {name: t.shape for name, t in GPT(model_config(cfg, corpus, torch.device("cpu"), folder))
                  .state_dict().items()}
    return gpt2_state_dict(folder, shapes)


def starting_values(model: GPT, weights: dict[str, torch.Tensor]) -> InitialValue:
    """`model.initial_value` with the folder's weights in place of the seeded draw: what a parameter is made real
    at, in every layout (buffers, as the causal mask, stay the model's own)."""
    def initial_value(name: str) -> torch.Tensor:
        # a copy: on the CPU, .to() in materialize copies nothing, and training would change the caller's tensors
        return weights[name].clone() if name in weights else model.initial_value(name)

    return initial_value


# ------------------------------------------------------------------------------------------------------- the job
def model_config(cfg: TrainConfig, corpus: CharCorpus, device: torch.device,
                 folder: Optional[Gpt2Folder] = None) -> GPTConfig:
    """The model as this run builds it: its vocabulary and context from the data (from a starting folder, its own:
    a larger vocabulary is kept whole, as are its positions), its attention resolved for the device and precision
    (a snapshot records what ran, not "auto")."""
    block_size = cfg.data_config.block_size
    amp_dtype = resolve_precision(cfg.trainer_config.mixed_precision, device)
    attention = resolve_attention(cfg.gpt_config.attention, device, amp_dtype, block_size, cfg.gpt_config.dropout)
    shape = {"vocab_size": corpus.tokenizer.size, "block_size": block_size} if folder is None else {
        "vocab_size": folder.vocab_size, "block_size": folder.n_positions}
    return dataclasses.replace(cfg.gpt_config.model(), **shape, attention=attention)


def build_trainer(cfg: TrainConfig, corpus: CharCorpus, ctx: DistContext, run_dir: Optional[Path],
                  with_snapshots: bool = True, store: Optional[SnapshotStore] = None,
                  folder: Optional[Gpt2Folder] = None,
                  weights: Optional[dict[str, torch.Tensor]] = None) -> Trainer:
    """Collective. Model, its layout over the processes with the optimizers, schedule, snapshot store and Trainer,
    as a training run (and benchmarks/bench.py) gets them. `store`: the run's snapshot store if it was opened
    already (`open_snapshot_store`). `folder` (gpt_config.init_from, `from_folder`): the model's shape; `weights`:
    its starting weights (`starting_weights`), in place of the seeded draw: a snapshot to resume, restored by
    the Trainer, still wins over them."""
    amp_dtype = resolve_precision(cfg.trainer_config.mixed_precision, ctx.device)
    check_optimizer_fits(cfg.optimizer_config, amp_dtype)
    gpt_cfg = model_config(cfg, corpus, ctx.device, folder)
    seed = cfg.trainer_config.seed  # the same initial weights on every rank, in every layout
    if weights is not None or builds_on_meta(cfg.parallel_config, ctx.world_size):
        with torch.device("meta"):  # shapes only: parallelize makes each part real on its way to its shards
            model = GPT(gpt_cfg, seed=seed)
    else:
        model = GPT(gpt_cfg, seed=seed).to(ctx.device)
    log.info("model: %s parameters, %s attention", f"{model.num_params():,}", gpt_cfg.attention)
    optimizers = functools.partial(build_optimizer, cfg=cfg.optimizer_config)
    initial_value = None if weights is None else starting_values(model, weights)
    parallel = parallelize(model, cfg.parallel_config, ctx, amp_dtype, optimizers, initial_value)
    if folder is not None and weights is not None:
        log.info("starting weights: %s (gpt_config.init_from; a snapshot to resume wins over them)", folder.path)
    if store is None and with_snapshots:
        store = open_snapshot_store(cfg)
    metadata = {
        "model_config": dataclasses.asdict(gpt_cfg),
        **tokenizer_fields(corpus.tokenizer.describe()),  # a snapshot alone generates text
        "strategy": cfg.parallel_config.strategy,
        "optimizer_name": cfg.optimizer_config.name,  # "optimizer" is its state
        "train_config": redacted(dataclasses.asdict(cfg)),
    }
    schedule = functools.partial(lr_factor, cfg=cfg.optimizer_config)
    return Trainer(cfg.trainer_config, parallel, schedule, corpus.train_dataset(), corpus.val_dataset(), run_dir,
                   snapshots=store, snapshot_metadata=metadata)


def open_snapshot_store(cfg: TrainConfig) -> SnapshotStore:
    """The run's snapshot store, checked (in seconds) by the ranks that write to it: global rank 0, and every rank
    of a layout that saves shards (FSDP, tensor and pipeline parallelism)."""
    tc = cfg.trainer_config
    store = SnapshotStore(resolve_path(tc.snapshot_path), tc.snapshot_storage_options)
    if global_rank() == 0 or writes_shards(cfg.parallel_config, world_size()):
        store.check_writable()
    return store


def train(cfg: TrainConfig, run_dir: Path, overrides: Sequence[str] = ()) -> None:
    """Read the data, join the job, fit, report. Leaves the process group to the caller (see hydra_main).
    `overrides`: the command line's, which a starting folder's shape may not contradict."""
    setup_logging(global_rank(), run_dir)
    cfg, folder = from_folder(cfg, overrides)  # gpt_config.init_from: its config.json sets the model and tokenizer
    # Where the run will write, before anything expensive (reading a large corpus, building the model).
    store = open_snapshot_store(cfg)
    # Bad data fails here, before any process group. One process per node builds a missing cache: the others wait.
    corpus = CharCorpus.load(cfg.data_config, build=local_rank() == 0)
    # A starting folder's weights, read and checked here: a missing or damaged file is one line, before any group
    weights = None if folder is None else starting_weights(cfg, corpus, folder)
    check_launch_environment()
    ctx = setup_distributed()
    configure_device(ctx.device)
    log.info("run directory: %s (rank 0 is process %d, started by %d)", run_dir, os.getpid(), os.getppid())
    log.info("data: %s", corpus.describe())
    trainer = build_trainer(cfg, corpus, ctx, run_dir, store=store, folder=folder, weights=weights)
    weights = None  # the model holds its own copy: not kept for the whole run
    tracking = Tracking(cfg.tracking_config, redacted(dataclasses.asdict(cfg)), trainer.metrics, store, run_dir)
    on_abrupt_exit(trainer.checkpoints.finish_quietly)  # a snapshot being written is finished first
    trainer.fit()
    if trainer.trained_steps and not trainer.stopped_early and cfg.trainer_config.report_at_end:
        whole = model_config(cfg, corpus, ctx.device, folder)
        model = trainer.full_model_copy(lambda: GPT(whole))  # gathered from shards and stages
        if trainer.ctx.is_main:
            report_results(trainer, model, corpus, run_dir)
    tracking.finish(trainer.stopped_early)  # after the plot: it goes to the trackers too


def report_results(trainer: Trainer, model: GPT, corpus: CharCorpus, run_dir: Path) -> None:
    """Rank 0, after training: the loss plot (drawn meanwhile by another process) and a short sample in the log;
    neither for weights that are not finite (sampling would fail on NaN probabilities)."""
    not_finite = nonfinite_tensors(dict(model.state_dict()))
    if not_finite:
        log.warning("no loss plot or sample: the weights are not finite (%s)", describe_nonfinite(not_finite))
        return
    plotter = LossPlotter(run_dir)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(trainer.cfg.seed)
    with one_core_spared():
        text = generate_text(model.eval(), corpus.tokenizer, "\n", 200, 0.8, 40, generator)
    plotter.log_result()  # and ends it
    log.info("sample (temperature 0.8, top_k 40):\n%s", text.strip("\n"))


def report_error(error: BaseException) -> int:
    """One line for a mistake the user can fix, the traceback for a bug; printed by one rank only: the first of the
    job to fail (the errors of peers that fail because of it, or with the same error, say nothing new). The exit
    code."""
    usage = isinstance(error, UsageError)
    if report_failure(str(error) if usage else describe(error)):
        if usage:
            rank = global_rank()
            print(f"{f'[rank {rank}] ' if rank else ''}error: {error}", file=sys.stderr, flush=True)
        else:
            # A bug: keep the whole traceback, but not Hydra's own report, whose first line repeats every
            # override (snapshot_storage_options values included) into the job's log.
            traceback.print_exception(error)
            sys.stderr.flush()
    return error.exit_code if usage else 1


def run_training(cfg: DictConfig) -> None:
    """The Hydra task: one job (several under -m), in the run directory Hydra made."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if global_rank() == 0:
        sweep_dir = Path(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else None
        scrub_hydra_output(run_dir, cfg, sweep_dir)
    try:
        settings = to_dataclasses(cfg, TrainConfig)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # Each job of a sweep gets its own snapshots, named by its swept values: rerunning the sweep resumes each.
            job_name = sweep_job_name(sys.argv[1:], list(hydra_cfg.overrides.task)) or str(hydra_cfg.job.num)
            settings.trainer_config.snapshot_path = f"{settings.trainer_config.snapshot_path.rstrip('/')}/{job_name}"
        train(settings, run_dir, list(hydra_cfg.overrides.task))
    except Exception as error:
        code = report_error(error)  # first, before anything that could wait for peers
        abandon_distributed()  # no collective teardown: a peer may never reach it
        sys.exit(code)
    leave_distributed()


hydra_main = hydra.main(version_base="1.3", config_path=".", config_name=CONFIG_NAME)(run_training)


def cli() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        print(config.help_text(TrainConfig))
        return
    config.register(TrainConfig)
    try:
        check_torch_supported()  # an older torch: one line here, not a TypeError from inside torch later
        config.precheck_overrides(TrainConfig, sys.argv[1:])  # a bad override in one line, before a run directory
    except UsageError as e:
        sys.exit(report_error(e))
    hydra_main()


if __name__ == "__main__":
    cli()
    # All written, the group left: no interpreter teardown (0.3-1.6 s of a short run), whose C++ destructors now
    # and then aborted a cleanly ended worker (SIGABRT, "terminate called without an active exception").
    exit_now(0)
