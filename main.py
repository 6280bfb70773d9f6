"""Train a character-level GPT with DistributedDataParallel. The only module that knows Hydra.

    torchrun --standalone --nproc_per_node=4 main.py                       # a 4-GPU node
    torchrun --standalone --nproc_per_node=2 main.py preset=cpu            # a CPU machine, 2 processes
    python main.py preset=cpu trainer_config.max_steps=200                 # one process, no torchrun
    python main.py gpt_config.n_layer=4 trainer_config.max_epochs=20       # any setting, Hydra style

Steps: compose gpt2_train_cfg.yaml with the overrides (checked against the dataclass schemas below, before any
process group exists) -> read the text -> set up the process group -> build GPT and AdamW -> Trainer.fit().
"""

from __future__ import annotations

from orphans import exit_with_parent

exit_with_parent()  # before the imports below: torch alone takes seconds, and the agent may die meanwhile

import atexit
import dataclasses
import functools
import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from char_dataset import CharCorpus, DataConfig, resolve_path
from distributed import (
    abandon_distributed, check_launch_environment, global_rank, leave_distributed, on_abrupt_exit, report_failure,
    setup_distributed,
)  # fmt: skip
from errors import UsageError, describe, first_line
from model import GPT, GPTConfig
from optim import OptimizerConfig, build_optimizer, learning_rate
from plot import write_loss_plot
from sample import generate_text
from snapshot import SnapshotStore
from trainer import DistContext, Trainer, TrainerConfig

PROJECT_DIR = Path(__file__).resolve().parent
CONFIG_NAME = "gpt2_train_cfg"
log = logging.getLogger("mingpt")


@dataclass
class TrainConfig:
    """The whole job; each section goes to the component that owns it."""

    data_config: DataConfig = field(default_factory=DataConfig)
    gpt_config: GPTConfig = field(default_factory=GPTConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer_config: TrainerConfig = field(default_factory=TrainerConfig)


# Registered under a name other than the YAML's, and listed first in the YAML's defaults: every key and value in
# the YAML and on the command line is then checked against these dataclasses.
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


# Every rank runs @hydra.main, but only global rank 0 may write Hydra's .hydra/ folder (config, overrides).
OmegaConf.register_new_resolver("rank_zero_only", lambda value: value if global_rank() == 0 else None)


# ------------------------------------------------------------------------------------------------------- config
def compose_config(overrides: list[str]) -> TrainConfig:
    """gpt2_train_cfg.yaml + overrides as validated dataclasses, for tools other than training (bench.py)."""
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise UsageError(f"unknown options: {' '.join(flags)}")
    return to_dataclasses(precheck_config_overrides(CONFIG_NAME, overrides)[0])


# Hydra's command-line flags: those whose next argument (or `=value`) is their value, those without one, and those
# after which the config is no longer ours to check (another config file, shell completion, Hydra's own info).
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}
HYDRA_FLAGS = {"--multirun", "-m", "--run", "-r", "--resolve"}
HYDRA_MODES = {"--run": {"--run", "-r"}, "--multirun": {"--multirun", "-m"}, "--cfg": {"--cfg", "-c"}}
HYDRA_FLAGS_ELSEWHERE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--info", "-i",
                         "--shell-completion", "-sc", "--version", "--hydra-help", "--experimental-rerun"}  # fmt: skip


def split_hydra_flags(args: list[str]) -> Optional[tuple[set[str], list[str]]]:
    """(flags, overrides) of a command line; None when a flag points Hydra at something other than our config."""
    flags: set[str] = set()
    overrides: list[str] = []
    rest = iter(args)
    for arg in rest:
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        name = arg.split("=", 1)[0]
        if name in HYDRA_FLAGS_ELSEWHERE:
            return None
        if name in HYDRA_FLAGS_WITH_VALUE:
            if "=" not in arg:
                next(rest, None)
        elif name not in HYDRA_FLAGS:
            raise UsageError(f"unknown option {name} (see --help)")
        flags.add(name)
    modes = {mode for mode, names in HYDRA_MODES.items() if flags & names}
    if len(modes) > 1:
        raise UsageError(f"only one of {', '.join(sorted(modes))} can be given")
    return flags, overrides


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Overrides enough to check every value of a sweep (`-m`): each swept key with each of its values, the other
    swept keys at their first value; not the whole cartesian product."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
        for o in parsed
    ]
    first = [values[0] for values in choices]
    jobs = [first] + [first[:i] + [value] + first[i + 1 :] for i, values in enumerate(choices) for value in values[1:]]
    return jobs


def precheck_config_overrides(config_name: str, args: list[str]) -> Optional[list[DictConfig]]:
    """Compose a config (one per job of a sweep) with Hydra's compose API, so that a bad override fails with one
    line.

    Hydra's own report of the same error spans several lines plus a hint about HYDRA_FULL_ERROR. Its flags are
    set aside (`--cfg job`, `-m`: under `-m` every swept value is checked); with flags that load another config
    (`--config-name`, ...) the check is left to Hydra itself (returns None)."""
    split = split_hydra_flags(args)
    if split is None:
        return None
    flags, overrides = split
    from hydra import compose, initialize_config_dir

    jobs = sweep_jobs(overrides) if flags & {"--multirun", "-m"} else [overrides]
    try:
        with initialize_config_dir(config_dir=str(PROJECT_DIR), version_base="1.3"):
            composed = [compose(config_name=config_name, overrides=job) for job in jobs]
    except Exception as e:  # Hydra raises several exception types; all are user errors here
        cause = e.__cause__ or e.__context__
        detail = f" {first_line(cause)}" if cause is not None and first_line(cause) != first_line(e) else ""
        raise UsageError(f"{first_line(e)}{detail}") from None
    return composed


def precheck_overrides(overrides: list[str]) -> None:
    """The training config with these overrides, checked (keys, types, values) before Hydra makes a run folder."""
    for composed in precheck_config_overrides(CONFIG_NAME, overrides) or []:
        to_dataclasses(composed)


def _check_known_keys(section: DictConfig, schema: type, prefix: str) -> None:
    """Hydra accepts `+section.new_key=...` even against a schema; a key nothing reads is a mistake."""
    allowed = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(section.keys()) - allowed)
    if unknown:
        raise UsageError(f"unknown config key {prefix}.{unknown[0]} (known keys: {', '.join(sorted(allowed))})")


def to_dataclasses(cfg: DictConfig) -> TrainConfig:
    """The composed config as plain validated dataclasses (each `__post_init__` checks its own ranges)."""
    sections = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(cfg.keys()) - sections.keys())
    if unknown:
        raise UsageError(f"unknown config section {unknown[0]!r} (known: {', '.join(sections)})")
    schemas = {f.name: type(getattr(TrainConfig(), f.name)) for f in dataclasses.fields(TrainConfig)}
    built: dict[str, Any] = {}
    for name, schema in schemas.items():
        _check_known_keys(cfg[name], schema, name)
        built[name] = schema(**OmegaConf.to_container(cfg[name], resolve=True))
    for derived in ("vocab_size", "block_size"):
        if getattr(built["gpt_config"], derived) is not None:
            raise UsageError(f"gpt_config.{derived} is set from the data; leave it null")
    return TrainConfig(**built)


def redacted(config: dict) -> dict:
    """The config with every value of snapshot_storage_options hidden: it may hold credentials."""
    config = {section: dict(values) for section, values in config.items()}
    options = config["trainer_config"].get("snapshot_storage_options") or {}
    config["trainer_config"]["snapshot_storage_options"] = {key: "***" for key in options}
    return config


def _secret_strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _secret_strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _secret_strings(v)]
    return [str(value)] if value is not None and len(str(value)) >= 4 else []


def scrub_hydra_output(run_dir: Path, cfg: DictConfig, sweep_dir: Optional[Path] = None) -> None:
    """Hydra saves the config and the overrides in <run dir>/.hydra (and a sweep's in <sweep dir>/multirun.yaml);
    mask any storage option value there.

    Credentials belong in the environment (AWS_ACCESS_KEY_ID, ...), but one passed as an override must still not
    end up on disk."""
    node = cfg.trainer_config.snapshot_storage_options
    options = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    secrets = sorted(set(_secret_strings(options)), key=len, reverse=True)
    if not secrets:
        return
    paths = list((run_dir / ".hydra").glob("*.yaml"))
    if sweep_dir is not None and (sweep_dir / "multirun.yaml").is_file():
        paths.append(sweep_dir / "multirun.yaml")
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for secret in secrets:
            text = text.replace(secret, "***")
        path.write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------------------------------------- logging
class _ConsoleHandler(logging.Handler):
    """Writes to stdout through tqdm, so that messages appear above a progress bar instead of breaking it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:
            self.handleError(record)


def setup_logging(rank: int, run_dir: Optional[Path]) -> None:
    """Rank 0 logs INFO to stdout and to train.log in the run directory; other ranks only warnings, prefixed."""
    root = logging.getLogger()
    root.handlers.clear()
    if rank == 0:
        fmt = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        console = _ConsoleHandler()
        console.addFilter(lambda record: getattr(record, "console", True))  # per-step lines hidden under a bar
        handlers: list[logging.Handler] = [console]
        if run_dir is not None:
            handlers.append(logging.FileHandler(run_dir / "train.log", encoding="utf-8"))
        level = logging.INFO
    else:
        fmt = logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s")
        handlers = [logging.StreamHandler(sys.stderr)]
        level = logging.WARNING
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notices are not ours
    logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found endpoint for s3 via: ..." and the like
    # When S3 drops a connection mid-upload, aiohttp (under s3fs) leaves asyncio "Future exception was never
    # retrieved" reports, each a traceback; the failed save itself is reported in one line by the snapshot writer.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def configure_device(device: torch.device) -> None:
    if device.type == "cuda":
        # TF32 tensor cores for fp32 matmuls: ~8x the throughput, ample precision for training.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


# ------------------------------------------------------------------------------------------------------- the job
def build_trainer(
    cfg: TrainConfig, corpus: CharCorpus, ctx: DistContext, run_dir: Optional[Path], with_snapshots: bool = True
) -> Trainer:
    """Model, optimizer, schedule, snapshot store and Trainer, exactly as a training run gets them (bench.py too)."""
    gpt_cfg = dataclasses.replace(cfg.gpt_config, vocab_size=len(corpus.vocab), block_size=cfg.data_config.block_size)
    torch.manual_seed(cfg.trainer_config.seed)  # identical initial weights on every rank
    model = GPT(gpt_cfg).to(ctx.device)
    log.info("model: %s parameters", f"{model.num_params():,}")
    optimizer = build_optimizer(model, cfg.optimizer_config)
    schedule = functools.partial(_lr_at, opt_cfg=cfg.optimizer_config)
    tc = cfg.trainer_config
    store = SnapshotStore(resolve_path(tc.snapshot_path), tc.snapshot_storage_options) if with_snapshots else None
    metadata = {
        "model_config": dataclasses.asdict(gpt_cfg),
        "vocab": corpus.vocab.chars,
        "train_config": redacted(dataclasses.asdict(cfg)),
    }
    return Trainer(
        tc, model, optimizer, schedule, corpus.train_dataset(), corpus.val_dataset(), ctx, run_dir,
        snapshots=store, snapshot_metadata=metadata,
    )  # fmt: skip


def train(cfg: TrainConfig, run_dir: Path) -> None:
    """Read the data, join the job, fit, report. Leaves the process group to the caller (see hydra_main)."""
    corpus = CharCorpus.load(cfg.data_config)  # bad data fails here, before any process group
    check_launch_environment()
    ctx = setup_distributed()
    setup_logging(ctx.rank, run_dir)
    configure_device(ctx.device)
    log.info("run directory: %s", run_dir)
    log.info("data: %s characters, vocabulary of %d", f"{corpus.data.numel():,}", len(corpus.vocab))
    trainer = build_trainer(cfg, corpus, ctx, run_dir)
    on_abrupt_exit(trainer.finish_snapshot_quietly)  # a snapshot being written is finished first
    trainer.fit()
    if ctx.is_main and trainer.trained_steps and not trainer.stopped_early:
        report_results(trainer, corpus, run_dir)


def report_results(trainer: Trainer, corpus: CharCorpus, run_dir: Path) -> None:
    """Rank 0, after training: the loss plot in the run directory and a short generated sample in the log."""
    try:
        log.info("loss plot: %s", write_loss_plot(run_dir))
    except ImportError:
        log.info("loss plot skipped: matplotlib is not installed")
    generator = torch.Generator(device=trainer.ctx.device).manual_seed(trainer.cfg.seed)
    trainer.raw_model.eval()
    text = generate_text(trainer.raw_model, corpus.vocab, "\n", 200, 0.8, 40, generator)
    trainer.raw_model.train()
    log.info("sample (temperature 0.8, top_k 40):\n%s", text.strip("\n"))


def _lr_at(step: int, total_steps: int, opt_cfg: OptimizerConfig) -> float:
    return learning_rate(step, opt_cfg, total_steps)


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
    return 2 if usage else 1


@hydra.main(version_base="1.3", config_path=".", config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if global_rank() == 0:
        sweep_dir = Path(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else None
        scrub_hydra_output(run_dir, cfg, sweep_dir)
    try:
        settings = to_dataclasses(cfg)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # Each job of a sweep gets its own snapshots, named by its swept values: rerunning the sweep resumes each.
            job_name = sweep_job_name(sys.argv[1:], list(hydra_cfg.overrides.task)) or str(hydra_cfg.job.num)
            settings.trainer_config.snapshot_path = f"{settings.trainer_config.snapshot_path.rstrip('/')}/{job_name}"
        train(settings, run_dir)
    except Exception as error:
        code = report_error(error)  # first, before anything that could wait for peers
        abandon_distributed()  # no collective teardown: a peer may never reach it
        sys.exit(code)
    leave_distributed()


def sweep_job_name(argv: list[str], job_overrides: list[str]) -> str:
    """`key=value,...` of the parameters a sweep varies (e.g. optimizer_config.learning_rate=0.001)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    swept = {o.key_or_group for o in parser.parse_overrides([a for a in argv if not a.startswith("-")])
             if o.is_sweep_override()}  # fmt: skip
    job = parser.parse_overrides(job_overrides)
    return ",".join(f"{o.key_or_group}={o.value()}" for o in job if o.key_or_group in swept)


def help_text() -> str:
    """`--help`: the config groups and every field with its description, read from the YAML files."""
    lines = [
        "mingpt-ddp: train a character-level GPT with DistributedDataParallel.",
        "",
        "Usage: torchrun --standalone --nproc_per_node=N main.py [override ...]    (or: python main.py ...)",
        "Override any field as section.key=value, e.g. trainer_config.max_epochs=20 gpt_config.n_layer=4",
        "Hydra flags: --cfg job (print the resolved config), -m (sweep, single process), --hydra-help",
        "",
        "Config groups:",
        "  preset: " + ", ".join(sorted(p.stem for p in (PROJECT_DIR / "preset").glob("*.yaml")))
        + "   (e.g. preset=cpu; files in preset/)",
        "",
        "Fields (gpt2_train_cfg.yaml):",
    ]
    in_hydra = False
    for raw in (PROJECT_DIR / f"{CONFIG_NAME}.yaml").read_text(encoding="utf-8").splitlines():
        if not raw.strip() or raw.lstrip().startswith("#") or raw.startswith(("defaults", "  -")):
            continue
        in_hydra = raw.startswith("hydra:") or (in_hydra and raw.startswith(" "))
        if in_hydra:
            continue
        if not raw.startswith(" "):
            lines.append(f"  {raw.split(':')[0]}")
            continue
        setting, _, description = raw.partition("#")
        key, _, default = setting.strip().partition(":")
        lines.append(f"    {key:<26} {default.strip():<18} {description.strip()}")
    return "\n".join(lines)


def cli() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        print(help_text())
        return
    try:
        precheck_overrides(sys.argv[1:])
    except UsageError as e:
        sys.exit(report_error(e))
    hydra_main()


def exit_without_teardown(code: Any) -> None:
    """Leave the process as `sys.exit(code)` would, minus CPython's teardown of every module and object.

    By now everything is written and closed. Freeing torch's thousands of modules one by one takes 1-2 s on a
    2-core machine, 2-4% of the CPU quick-start's whole run, for nothing. Exit handlers (`atexit`) still run
    and the streams are flushed; only the module teardown is skipped.
    """
    if isinstance(code, str):  # sys.exit("message") prints the message and exits with 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        cli()
    except SystemExit as done:  # user errors and Hydra's own exits (bad overrides, --cfg job, ...)
        exit_without_teardown(done.code)
    exit_without_teardown(0)
