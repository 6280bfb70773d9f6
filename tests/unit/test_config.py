"""The YAML + schema (config.py), composed with Hydra's compose API exactly as main.py composes it."""

import dataclasses
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from support import TINY, project_modules

from main import TrainConfig
from mingpt import config
from mingpt.errors import UsageError
from sample import SampleConfig


def compose_cfg(overrides: list[str] | None = None):
    config.register(TrainConfig)
    with initialize_config_dir(config_dir=str(config.PROJECT_DIR), version_base="1.3"):
        return compose(config_name=config.CONFIG_NAME, overrides=overrides or [])


def test_defaults_compose_to_valid_dataclasses():
    cfg = config.to_dataclasses(compose_cfg(), TrainConfig)
    assert cfg.data_config.path == "data/input.txt"
    assert cfg.trainer_config.max_steps is None
    assert cfg.trainer_config.mixed_precision == "auto"
    assert cfg.gpt_config.vocab_size is None


@pytest.mark.parametrize(
    "yaml_name, schemas",
    [("gpt2_train_cfg.yaml", config.section_schemas(TrainConfig)), ("sample_cfg.yaml", {"": SampleConfig})],
)
def test_yaml_comments_are_the_dataclass_help(yaml_name, schemas):
    """One source: each field's help is the docstring under it; the YAML's comment for the key must say the same."""
    in_yaml = config.yaml_fields(config.PROJECT_DIR / yaml_name)
    assert set(in_yaml) == set(schemas)
    for section, schema in schemas.items():
        helps = config.field_help(schema)
        names = [f.name for f in dataclasses.fields(schema)]
        assert list(helps) == names, f"{schema.__name__}: fields without a docstring: {set(names) - set(helps)}"
        assert list(in_yaml[section]) == names, f"{yaml_name}: {section} keys differ from {schema.__name__}'s"
        for key, help in helps.items():
            comment = in_yaml[section][key][1]
            assert comment == help, f"{yaml_name}: {section}.{key} says {comment!r}, {schema.__name__} says {help!r}"


def test_help_lists_every_field_with_its_help():
    text = config.help_text(TrainConfig)
    for section, schema in config.section_schemas(TrainConfig).items():
        for key, help in config.field_help(schema).items():
            assert any(line.split()[0] == key and line.endswith(help) for line in text.splitlines() if line.strip())


def test_required_keys_exist():
    cfg = compose_cfg()
    for key in [
        "data_config.path", "data_config.block_size", "data_config.train_split", "data_config.truncate",
        "gpt_config.n_layer", "gpt_config.n_head", "gpt_config.n_embd", "gpt_config.dropout",
        "optimizer_config.learning_rate", "optimizer_config.weight_decay", "optimizer_config.warmup_steps",
        "optimizer_config.decay_steps", "optimizer_config.min_lr",
        "trainer_config.max_epochs", "trainer_config.max_steps", "trainer_config.batch_size",
        "trainer_config.grad_accum_steps", "trainer_config.grad_norm_clip", "trainer_config.mixed_precision",
        "parallel_config.compile", "trainer_config.seed", "trainer_config.eval_every_steps",
        "trainer_config.log_every_steps", "trainer_config.data_loader_workers", "trainer_config.snapshot_path",
        "trainer_config.save_every",
    ]:
        section, name = key.split(".")
        assert name in cfg[section], key


def test_overrides_apply_with_types():
    overrides = ["trainer_config.max_epochs=20", "gpt_config.n_layer=4", "trainer_config.max_steps=100",
                 "optimizer_config.learning_rate=5e-4"]
    cfg = config.to_dataclasses(compose_cfg(overrides), TrainConfig)
    assert cfg.trainer_config.max_epochs == 20 and cfg.gpt_config.n_layer == 4
    assert cfg.trainer_config.max_steps == 100 and cfg.optimizer_config.learning_rate == 5e-4


def test_cpu_preset():
    cfg = config.to_dataclasses(compose_cfg(["preset=cpu"]), TrainConfig)
    assert cfg.gpt_config.n_embd == 128 and cfg.trainer_config.mixed_precision == "auto"
    # command-line overrides still win over the preset
    cfg = config.to_dataclasses(compose_cfg(["preset=cpu", "trainer_config.max_steps=7"]), TrainConfig)
    assert cfg.trainer_config.max_steps == 7


def test_typo_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(["trainer_config.max_epoch=3"])
    assert "max_epoch" in str(info.value.__cause__)


def test_wrong_type_fails():
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(["trainer_config.batch_size=abc"])
    assert "could not be converted to Integer" in str(info.value.__cause__)


# Overrides main.py refuses before Hydra runs, each with its one line (a regex), on top of a 10-step TINY run's
# overrides as tests/e2e/test_bad_input.py gives them: that table runs a row of each kind through the real CLI (exit
# code 2, the line on stderr, no snapshot touched, no run folder); these go through the same check,
# config.precheck_overrides, here.
PRECHECK_REFUSALS = {
    "a misspelled key": (["trainer_config.max_epoch=3"], re.escape("Key 'max_epoch' not in 'TrainerConfig'")),
    "a wrong type": (["trainer_config.batch_size=abc"], "could not be converted to Integer"),
    "+new_key": (["+trainer_config.new_key=1"], re.escape("unknown config key trainer_config.new_key")),
    "+section": (["+extra=1"], "unknown config section 'extra'"),
    "n_head not dividing n_embd": (["gpt_config.n_head=5"], r"must be divisible by gpt_config\.n_head"),
    "zero batch size": (["trainer_config.batch_size=0"], "batch_size must be positive"),
    "train_split above 1": (["data_config.train_split=1.5"], re.escape("train_split must be in (0, 1)")),
    "unknown precision": (["trainer_config.mixed_precision=fp8"], "mixed_precision must be one of"),
    "vocab_size set by hand": (["gpt_config.vocab_size=10"], "vocab_size is set from the data"),
    "unknown preset": (["preset=nope"], re.escape("Could not find 'preset/nope'")),
    "an old key's redirect": (["trainer_config.strategy=fsdp"],
                              re.escape("trainer_config.strategy is now parallel_config.strategy")),
    "an old key's redirect (+)": (["+trainer_config.compile=true"],
                                  re.escape("trainer_config.compile is now parallel_config.compile")),
    "an old key's redirect (a sweep)": (
        ["-m", "trainer_config.activation_checkpointing=blocks,none"],
        re.escape("trainer_config.activation_checkpointing is now parallel_config.activation_checkpointing")),
    "config: +new_key": (["+trainer_config.max_epoch=3"],
                         r"unknown config key trainer_config\.max_epoch \(known keys: .*max_epochs"),
    "config: dropout out of range": (["gpt_config.dropout=1.5"], r"gpt_config\.dropout must be in \[0, 1\), got 1\.5"),
    "config: unknown attention implementation": (
        ["gpt_config.attention=flash"], r"gpt_config\.attention must be one of auto, sdpa, matmul, got 'flash'"),
    "config: unknown strategy": (["parallel_config.strategy=zero3"],
                                 r"parallel_config\.strategy must be one of ddp, fsdp, got 'zero3'"),
    "config: unknown activation checkpointing": (
        ["parallel_config.activation_checkpointing=all"],
        r"parallel_config\.activation_checkpointing must be one of none, blocks, got 'all'"),
    "config: zero keep_last": (["trainer_config.keep_last=0"], r"trainer_config\.keep_last must be positive, got 0"),
    "config: min_lr above learning_rate": (["optimizer_config.min_lr=0.01"],
                                           r"min_lr must be in \[0, learning_rate=0\.003\], got 0\.01"),
    "config: n_embd not divisible by n_head": (["gpt_config.n_head=3"], r"divisible by gpt_config\.n_head"),
    "config: decay ends before warmup": (["optimizer_config.decay_steps=3"],
                                         r"decay_steps \(3\) must be larger than optimizer_config\.warmup_steps \(5\)"),
    "command line: negative batch size": (["trainer_config.batch_size=-4"], r"batch_size must be positive"),
    "zero learning rate": (["optimizer_config.learning_rate=0"], "learning_rate must be positive"),
    "command line: negative learning rate": (["optimizer_config.learning_rate=-1e-3"],
                                             r"learning_rate must be positive"),
    "command line: train_split of 1": (["data_config.train_split=1.0"], r"train_split must be in \(0, 1\)"),
    "command line: train_split of 0": (["data_config.train_split=0"], r"train_split must be in \(0, 1\)"),
    "layout: more stages than blocks": (["parallel_config.pp=4"], r"4 pipeline stages"),
    "layout: pp_layers not summing": (["parallel_config.pp=2", "parallel_config.pp_layers=[1,2]"],
                                      r"must give each of the 2 pipeline stages its blocks"),
    "layout: fp16 with a pipeline": (["parallel_config.pp=2", "trainer_config.mixed_precision=fp16"],
                                     r"not offered with pipeline parallelism"),
    "layout: the zero-bubble schedule": (["parallel_config.pp=2", "parallel_config.pp_schedule=ZBVZeroBubble"],
                                         r"trains wrong without an error"),
}


@pytest.mark.parametrize("overrides, line", PRECHECK_REFUSALS.values(), ids=PRECHECK_REFUSALS.keys())
def test_precheck_gives_one_line(overrides, line):
    with pytest.raises(UsageError) as info:
        config.precheck_overrides(TrainConfig, [*TINY, "trainer_config.max_steps=10", *overrides])
    assert re.search(line, str(info.value)) and "\n" not in str(info.value), str(info.value)


def test_precheck_checks_around_hydra_flags():
    # Hydra prints it; the config is fine
    config.precheck_overrides(TrainConfig, ["--cfg", "job", "trainer_config.max_steps=3"])
    config.precheck_overrides(TrainConfig, ["--cfg=hydra", "trainer_config.max_steps=3"])
    config.precheck_overrides(TrainConfig, ["-m", "trainer_config.max_steps=3,4"])
    config.precheck_overrides(TrainConfig, ["--config-name", "other", "nonsense=1"])  # another config: Hydra's to check
    with pytest.raises(UsageError, match="Key 'max_step' not in"):
        config.precheck_overrides(TrainConfig, ["-m", "trainer_config.max_steps=1,2", "trainer_config.max_step=3"])
    with pytest.raises(UsageError, match="learning_rate=x .*could not be converted to Float"):
        config.precheck_overrides(TrainConfig, ["-m", "optimizer_config.learning_rate=1e-3,x",
                                                "trainer_config.max_steps=1,2"])


def test_sweep_jobs_cover_every_value_without_the_whole_product():
    jobs = config.sweep_jobs(["a=1,2,3", "b=x", "c=range(0,2)"])
    assert jobs == [["a=1", "b=x", "c=0"], ["a=2", "b=x", "c=0"], ["a=3", "b=x", "c=0"], ["a=1", "b=x", "c=1"]]


def test_the_project_reaches_hydra_through_its_public_interface_only():
    """Hydra's internals (hydra._internal) change between releases: no module of the project imports them; every
    run goes through @hydra.main and the compose API (the default run's own process: tests/e2e/test_cli.py)."""
    sources = project_modules()
    assert len(sources) > 10
    offenders = [p.name for p in sources if "hydra._internal" in p.read_text(encoding="utf-8")]
    assert offenders == []
