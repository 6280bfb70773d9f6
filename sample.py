"""Generate text from a snapshot alone (local or any fsspec URL, e.g. s3://).

    python sample.py snapshot=snapshots/cpu-quickstart prompt="ROMEO:" max_new_tokens=500 top_k=40 seed=1
    python sample.py snapshot=s3://bucket/run1/snapshot-000005000.pt num_samples=3
    python sample.py snapshot=snapshots/cpu-quickstart prompt_file=prompt.txt top_k=null
    python sample.py snapshot=snapshots/default which=best

`snapshot` is a snapshot file, or a snapshot folder (its newest valid snapshot is used; with which=best the one of
the lowest validation loss, where a run with trainer_config.keep_best=true marked it). Settings are Hydra-style
overrides of `sample_cfg.yaml`. The same seed gives the same text (on the same device).
"""

from __future__ import annotations

from mingpt import startup

startup.pause_collection(__name__)  # until its imports are done (mingpt/startup.py)

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import fsspec
import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from mingpt.checkpoint.store import (
    CorruptSnapshot,
    SnapshotStore,
    best_snapshot_url,
    describe_nonfinite,
    model_tensors,
    nonfinite_tensors,
    read_snapshot,
    snapshot_step,
)
from mingpt.config import precheck_config_overrides
from mingpt.data.tokenizer import Tokenizer, snapshot_tokenizer, tokenizer_from_description
from mingpt.errors import UsageError
from mingpt.storage.locations import resolve_path
from model import GPT, GPTConfig

startup.resume_collection(__name__)


@dataclass
class SampleConfig:
    """What to generate, and from which snapshot."""

    snapshot: str = MISSING
    """snapshot file or folder (its newest valid snapshot): local path (relative = project) or URL"""
    prompt: str = "\n"
    """text the samples continue"""
    prompt_file: Optional[str] = None
    """read the prompt from this UTF-8 file instead (local path or URL)"""
    max_new_tokens: int = 500
    """tokens generated per sample (characters under the character tokenizer)"""
    temperature: float = 0.8
    """< 1 more conservative, > 1 more adventurous"""
    top_k: Optional[int] = 40
    """sample only from the k likeliest tokens; null = all"""
    seed: int = 1
    """the same seed gives the same text"""
    num_samples: int = 1
    """independent samples, printed one after another"""
    device: str = "cpu"
    """cpu, cuda, cuda:N, or auto (cuda when available)"""
    storage_options: Any = None
    """extra fsspec options for reading the snapshot (credentials: use the environment)"""
    which: str = "newest"
    """newest | best: of a snapshot folder, its newest valid snapshot or the one of the lowest validation loss

    best: the snapshot a run with trainer_config.keep_best=true marked in the folder's best.json."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0 or self.num_samples <= 0:
            raise UsageError("max_new_tokens must be >= 0 and num_samples positive")
        if self.temperature <= 0:
            raise UsageError(f"temperature must be positive, got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            raise UsageError(f"top_k must be positive or null, got {self.top_k}")
        if self.which not in ("newest", "best"):
            raise UsageError(f"which must be newest or best, got {self.which!r}")


ConfigStore.instance().store(name="sample_schema", node=SampleConfig)


def load_snapshot(location: str, storage_options: Optional[dict] = None, which: str = "newest") -> dict:
    """A snapshot (a file, or a folder of shards), or of a folder of snapshots its newest valid one (`which`
    newest) or its best (`which` best: the lowest validation loss, marked by trainer_config.keep_best)."""
    url = resolve_path(location)  # a malformed URL is a UsageError here, never a local path
    if which == "best":
        url = best_snapshot_url(url, storage_options)
    if snapshot_step(url.rstrip("/").rpartition("/")[2]) is not None:
        try:
            return read_snapshot(url, storage_options)
        except CorruptSnapshot as e:
            raise UsageError(f"snapshot {e}") from None
    try:
        found = SnapshotStore(url, storage_options).load_newest_valid()
    except UsageError:
        raise
    except Exception as e:  # no permission, no credentials, an unreachable store, ...
        raise UsageError(f"cannot read snapshots in {url}: {type(e).__name__}: {_brief(e)}") from None
    if found is None:
        raise UsageError(f"no snapshot found at {url}")
    return found[1]


def model_from_snapshot(snapshot: dict, device: torch.device) -> tuple[GPT, Tokenizer]:
    """The snapshot's model (on `device`, in eval mode) and its tokenizer: all that generating text needs."""
    try:
        model = GPT(GPTConfig(**snapshot["model_config"]))
        model.load_state_dict(model_tensors(snapshot))  # a sharded snapshot's tensors are read whole, here
    except (TypeError, ValueError, RuntimeError) as e:  # weights that do not fit the snapshot's own model config
        raise UsageError(f"the snapshot's weights do not match its model config: {_brief(e)}") from None
    not_finite = nonfinite_tensors(dict(model.state_dict()))
    if not_finite:  # a diverged run's: sampling would fail on NaN probabilities
        raise UsageError(f"the snapshot's weights are not finite ({describe_nonfinite(not_finite)}): it is a "
                         f"diverged run's; take an older snapshot")
    return model.to(device).eval(), tokenizer_from_description(snapshot_tokenizer(snapshot))


def _brief(error: BaseException) -> str:
    """An error as one line of at most 300 characters (load_state_dict's first line alone says nothing)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())[:300]


@contextlib.contextmanager
def one_core_spared() -> Iterator[None]:
    """torch's CPU ops on one thread fewer meanwhile: at the end of a run the plotter's process draws on a core of
    its own, and an op split over every core's thread would wait for the one that shares it (on 2 cores, ~2x
    slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, previous - 1))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def generate_text(
    model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float, top_k: Optional[int],
    generator: torch.Generator,
) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, as text."""
    if not prompt:
        raise UsageError("the prompt is empty")
    device = next(model.parameters()).device
    ids = torch.from_numpy(tokenizer.encode(prompt).astype("int64")).to(device)[None, :]
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return tokenizer.decode(out[0])


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device={name} but CUDA is not available")
    return torch.device(name)


def _read_prompt(cfg: SampleConfig) -> str:
    if cfg.prompt_file is None:
        return cfg.prompt
    url = resolve_path(cfg.prompt_file)
    try:
        with fsspec.open(url, "rb") as f:
            return f.read().decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"prompt file not found: {url}") from None
    except UnicodeDecodeError:
        raise UsageError(f"prompt file {url} is not UTF-8 text") from None


def run(cfg: SampleConfig) -> list[str]:
    device = _device(cfg.device)
    model, vocab = model_from_snapshot(load_snapshot(cfg.snapshot, cfg.storage_options, cfg.which), device)
    prompt = _read_prompt(cfg)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    return [
        generate_text(model, vocab, prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, generator)
        for _ in range(cfg.num_samples)
    ]


def _exit_with(error: UsageError) -> None:
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=".", config_name="sample_cfg")
def hydra_main(cfg: DictConfig) -> None:
    try:
        if OmegaConf.is_missing(cfg, "snapshot"):
            raise UsageError("which snapshot? pass snapshot=PATH_OR_URL (a snapshot file or folder)")
        samples = run(SampleConfig(**OmegaConf.to_container(cfg, resolve=True)))
    except UsageError as e:
        _exit_with(e)
    for i, text in enumerate(samples):
        if i:
            print("\n" + "-" * 40)
        print(text)


def cli() -> None:
    try:
        precheck_config_overrides("sample_cfg", sys.argv[1:])
    except UsageError as e:
        _exit_with(e)
    hydra_main()


if __name__ == "__main__":
    cli()
