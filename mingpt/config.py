"""The config layer: registering a schema (a dataclass of sections, each a component's own dataclass; main.py's
TrainConfig for training), composing gpt2_train_cfg.yaml with the command line into validated dataclasses with
one-line errors, keys that moved named with their new place, sweep job names, the `--help` text and masking of
storage options. Each field's help is the docstring under it in its dataclass: `--help` prints it, and
gpt2_train_cfg.yaml carries it as the key's comment (tests/unit/test_config.py fails if the two drift apart).

    config.register(TrainConfig)                          # main.py, before Hydra composes anything
    cfg = config.compose_config(TrainConfig, overrides)   # tools other than training (bench.py, prepare.py)

The schema comes from the commands at the root: this package never imports them. Only this module and the
commands touch Hydra."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
from pathlib import Path
from typing import Any, Optional, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mingpt import PROJECT_DIR
from mingpt.distributed.process_group import global_rank
from mingpt.errors import UsageError, first_line

CONFIG_NAME = "gpt2_train_cfg"
Schema = TypeVar("Schema")


def register(schema: type) -> None:
    """Make the training schema and the resolver known to Hydra (before any composition; again: the same).

    The schema is registered under a name other than the YAML's and listed first in the YAML's defaults: every key
    and value in the YAML and on the command line is then checked against the dataclasses. Every rank composes the
    config, but only global rank 0 may write Hydra's .hydra/ folder (`${rank_zero_only:.hydra}`)."""
    ConfigStore.instance().store(name="train_schema", node=schema)
    if not OmegaConf.has_resolver("rank_zero_only"):
        OmegaConf.register_new_resolver("rank_zero_only", lambda value: value if global_rank() == 0 else None)


def compose_config(schema: type[Schema], overrides: list[str]) -> Schema:
    """gpt2_train_cfg.yaml + overrides as validated dataclasses, for tools other than training (bench.py)."""
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise UsageError(f"unknown options: {' '.join(flags)}")
    register(schema)
    return to_dataclasses(precheck_config_overrides(CONFIG_NAME, overrides, schema)[0], schema)


# Hydra's command-line flags: those whose next argument (or `=value`) is their value, those without one, and those
# after which the config is no longer ours to check (another config file, shell completion, Hydra's own info).
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}
HYDRA_FLAGS = {"--multirun", "-m", "--run", "-r", "--resolve"}
HYDRA_MODES = {"--run": {"--run", "-r"}, "--multirun": {"--multirun", "-m"}, "--cfg": {"--cfg", "-c"}}
HYDRA_FLAGS_ELSEWHERE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--info", "-i",
                         "--shell-completion", "-sc", "--version", "--hydra-help", "--experimental-rerun"}


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


def precheck_config_overrides(config_name: str, args: list[str],
                              schema: Optional[type] = None) -> Optional[list[DictConfig]]:
    """Compose a config (one per job of a sweep) with Hydra's compose API, so that a bad override fails with one
    line; a key the `schema` says has moved (its `moved_keys`) is named with its new place.

    Hydra's own report of the same error spans several lines plus a hint about HYDRA_FULL_ERROR. Its flags are
    set aside (`--cfg job`, `-m`: under `-m` every swept value is checked); with flags that load another config
    (`--config-name`, ...) the check is left to Hydra itself (returns None). The config's schema must be registered
    already (its command registers it)."""
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
        raise moved_key_error(e, schema) or composition_error(e) from None
    return composed


def composition_error(error: Exception) -> UsageError:
    """A failed composition (a bad override, a missing preset) in one line, with its cause when that adds to it."""
    cause = error.__cause__ or error.__context__
    detail = f" {first_line(cause)}" if cause is not None and first_line(cause) != first_line(error) else ""
    return UsageError(f"{first_line(error)}{detail}")


UNKNOWN_KEY = re.compile(r"Key '(\w+)' not in '(\w+)'")  # OmegaConf's words for a key its schema lacks


def moved_key_error(error: Exception, schema: Optional[type]) -> Optional[UsageError]:
    """A composition that failed on a key the schema's `moved_keys` ({"section.key": "new_section.key"}) lists,
    from the command line or a YAML file alike, as one line naming where the key is now; None for any other error."""
    moved = getattr(schema, "moved_keys", {}) if schema is not None else {}
    if not moved:
        return None
    sections = {section.__name__: name for name, section in section_schemas(schema).items()}
    cause = error.__cause__ or error.__context__
    for text in (str(error), str(cause or "")):
        found = UNKNOWN_KEY.search(text)
        key = found and f"{sections.get(found.group(2))}.{found.group(1)}"
        if key in moved:
            return _moved(key, moved)
    return None


def _moved(key: str, moved: dict[str, str]) -> UsageError:
    return UsageError(f"{key} is now {moved[key]}: set {moved[key]}=... instead")


def precheck_overrides(schema: type, overrides: list[str]) -> None:
    """The training config with these overrides, checked (keys, types, values) before Hydra makes a run folder."""
    register(schema)  # what is checked against: registered here, whatever ran before
    for composed in precheck_config_overrides(CONFIG_NAME, overrides, schema) or []:
        to_dataclasses(composed, schema)


def _check_known_keys(section: DictConfig, schema: type, prefix: str, moved: dict[str, str]) -> None:
    """Hydra accepts `+section.new_key=...` even against a schema; a key nothing reads is a mistake (and one that
    moved is named with its new place)."""
    allowed = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(section.keys()) - allowed)
    if unknown and f"{prefix}.{unknown[0]}" in moved:
        raise _moved(f"{prefix}.{unknown[0]}", moved)
    if unknown:
        raise UsageError(f"unknown config key {prefix}.{unknown[0]} (known keys: {', '.join(sorted(allowed))})")


def to_dataclasses(cfg: DictConfig, schema: type[Schema]) -> Schema:
    """The composed config as plain validated dataclasses (each `__post_init__` checks its own ranges, the schema's
    own the checks across sections)."""
    sections = section_schemas(schema)
    unknown = sorted(set(cfg.keys()) - sections.keys())
    if unknown:
        raise UsageError(f"unknown config section {unknown[0]!r} (known: {', '.join(sections)})")
    built: dict[str, Any] = {}
    for name, section in sections.items():
        _check_known_keys(cfg[name], section, name, getattr(schema, "moved_keys", {}))
        built[name] = section(**OmegaConf.to_container(cfg[name], resolve=True))
    return schema(**built)


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


def sweep_job_name(argv: list[str], job_overrides: list[str]) -> str:
    """`key=value,...` of the parameters a sweep varies (e.g. optimizer_config.learning_rate=0.001)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    swept = {o.key_or_group for o in parser.parse_overrides([a for a in argv if not a.startswith("-")])
             if o.is_sweep_override()}
    job = parser.parse_overrides(job_overrides)
    return ",".join(f"{o.key_or_group}={o.value()}" for o in job if o.key_or_group in swept)


# ------------------------------------------------------------------------------------------------------- help
def field_help(schema: type) -> dict[str, str]:
    """Each field's one-line help: the first line of the docstring under it in the dataclass (or in the dataclass
    it extends, for the fields it inherits), in the dataclass's field order."""
    helps: dict[str, str] = {}
    for base in reversed(schema.__mro__[:-1]):  # the base classes' fields come first, as dataclasses order them
        if dataclasses.is_dataclass(base):
            helps.update(_own_field_help(base))
    return helps


def _own_field_help(schema: type) -> dict[str, str]:
    """The help of the fields a dataclass's own body declares."""
    body = ast.parse(textwrap.dedent(inspect.getsource(schema))).body[0].body
    helps = {}
    for node, after in zip(body, body[1:]):
        docstring = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(docstring, str):
            helps[node.target.id] = docstring.strip().splitlines()[0]
    return helps


def section_schemas(schema: type) -> dict[str, type]:
    """The config's sections and their dataclasses, in the YAML's order."""
    defaults = schema()
    return {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(schema)}


def yaml_fields(path: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """A config YAML's keys as {section: {key: (value as written, comment)}}; top-level keys under section "".
    Hydra's own parts (defaults, hydra) are left out."""
    fields: dict[str, dict[str, tuple[str, str]]] = {}
    section: Optional[str] = None  # None: in a part that is Hydra's
    for raw in path.read_text(encoding="utf-8").splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        setting, _, comment = raw.partition(" #")
        key, _, value = (part.strip() for part in setting.partition(":"))
        if raw.startswith(" "):
            if section is not None:
                fields[section][key] = (value, comment.strip())
        elif key in ("defaults", "hydra"):
            section = None
        elif value:
            fields.setdefault("", {})[key] = (value, comment.strip())
            section = None
        else:
            section = key
            fields[section] = {}
    return fields


def help_text(schema: type) -> str:
    """`--help`: the config groups and every field with its default (the YAML's) and its help (the dataclass's)."""
    presets = ", ".join(sorted(p.stem for p in (PROJECT_DIR / "preset").glob("*.yaml")))
    lines = [
        "mingpt-ddp: train a character-level GPT with DistributedDataParallel.",
        "",
        "Usage: torchrun --standalone --nproc_per_node=N main.py [override ...]    (or: python main.py ...)",
        "Override any field as section.key=value, e.g. trainer_config.max_epochs=20 gpt_config.n_layer=4",
        "Hydra flags: --cfg job (print the resolved config), -m (sweep, single process), --hydra-help",
        "",
        "Config groups:",
        f"  preset: {presets}   (e.g. preset=cpu; files in preset/)",
        "",
        f"Fields ({CONFIG_NAME}.yaml):",
    ]
    defaults = OmegaConf.load(PROJECT_DIR / f"{CONFIG_NAME}.yaml")  # the YAML's values, read as YAML
    for section, section_schema in section_schemas(schema).items():
        lines.append(f"  {section}")
        for key, description in field_help(section_schema).items():
            lines.append(f"    {key:<26} {_as_yaml(defaults[section][key]):<18} {description}")
    return "\n".join(lines)


def _as_yaml(value: Any) -> str:
    if isinstance(value, str) and not value.isprintable():
        return json.dumps(value)  # a control character ("\n") as YAML's double-quoted form, on one line
    return OmegaConf.to_yaml({"v": value}).strip().removeprefix("v:").strip()
