"""A Hugging Face GPT-2 folder as this project's starting weights: the inverse of hf_export.py's GPT-2 row.

    folder = read_gpt2_folder("gpt2/")               # config.json: the shape and options; a UsageError if not GPT-2
    weights = gpt2_state_dict(folder, expected)      # model.safetensors (or its shards) under our names, verified

What it reads: `config.json` (a `GPT2LMHeadModel`'s: n_layer, n_head, n_embd, n_positions, vocab_size,
activation_function, tie_word_embeddings), the weights as safetensors (`model.safetensors`, or the shards a
`model.safetensors.index.json` names; never a pickle), and `tokenizer.json` (the tokenizer a run started from the
folder uses: main.py). GPT-2's parameter names are ours (its `transformer.` prefix absent in folders saved from a bare
`GPT2Model`, such as OpenAI's own); its Conv1D weights are stored transposed (hf_names.GPT2_CONV1D, the table the
export uses). GPT-2 always has biases, so the model gets bias=true (an export of a bias=false snapshot has zero
biases: the same function). Everything is checked before any process group exists: a folder of another
architecture, a setting our model cannot compute, a missing or damaged weights file, a tensor missing, left over, of
another shape or not finite, each a UsageError of one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mingpt.checkpoint.hf_names import ACTIVATIONS, GPT2_CONV1D
from mingpt.data.tokenizer import TOKENIZER_FILE
from mingpt.errors import UsageError, first_line
from mingpt.storage.locations import check_location, resolve_path

Tensors = dict[str, torch.Tensor]
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# transformers' activation names -> ours: the export's table inverted, and gelu_new, the tanh approximation as OpenAI's
# GPT-2 config names it (the same function as gelu_pytorch_tanh, computed by another formula: ~1e-7 apart)
IMPORTED_ACTIVATIONS = {**{theirs: ours for ours, theirs in ACTIVATIONS.items()}, "gelu_new": "gelu_tanh"}
# The epsilon of our LayerNorm (model.GPTConfig.norm_eps), which GPT-2's layer_norm_epsilon must be
LAYER_NORM_EPS = 1e-5
# Buffers GPT-2 checkpoints of older transformers saved with the weights (the causal mask): not parameters
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
# GPT-2 settings that change its function away from ours, with the value ours computes
EXACT_SETTINGS = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


@dataclass(frozen=True)
class Gpt2Folder:
    """What a GPT-2 folder's config.json fixes: the model options (GPTConfig's fields, by name), its vocabulary and
    its context (n_positions: block_size of the model), and where its tokenizer.json is."""

    path: Path
    options: dict[str, Any]
    vocab_size: int
    n_positions: int
    tokenizer: Path

    @property
    def shape(self) -> dict[str, Any]:
        """Every GPTConfig field the folder fixes, vocab_size and block_size included."""
        return {**self.options, "vocab_size": self.vocab_size, "block_size": self.n_positions}


def read_gpt2_folder(location: str) -> Gpt2Folder:
    """The folder's config.json as GPTConfig fields; a folder that is missing, not GPT-2, or GPT-2 with a setting our
    model does not compute is a UsageError naming it."""
    where = f"gpt_config.init_from={location}"
    if check_location(location, "gpt_config.init_from"):
        raise UsageError(f"{where}: a local folder, not a URL (download the model first)")
    path = Path(resolve_path(location))  # relative: to the project, as data_config.path
    if not path.is_dir():
        raise UsageError(f"{where}: no such folder (a Hugging Face GPT-2 folder: config.json, model.safetensors, "
                         f"tokenizer.json)")
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{where}: the folder has no {CONFIG_FILE}, so it is not a Hugging Face model") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{where}: cannot read its {CONFIG_FILE}: {first_line(e)}") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise UsageError(f"{where} is a {kind or 'unknown'} model, not GPT-2 (model_type gpt2, GPT2LMHeadModel): "
                         f"only GPT-2 folders can be started from")
    why = unsupported(config)
    if why is not None:
        raise UsageError(f"{where}: its GPT-2 has {why}, which this project's model does not compute")
    tokenizer = path / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise UsageError(f"{where}: the folder has no {TOKENIZER_FILE} (the tokenizer a run from it uses)")
    n_embd = int(config.get("n_embd", 768))
    options = {"n_layer": int(config.get("n_layer", 12)), "n_head": int(config.get("n_head", 12)), "n_embd": n_embd,
               "bias": True, "positions": "learned", "norm": "layernorm",
               "activation": IMPORTED_ACTIVATIONS[config.get("activation_function", "gelu_new")], "qk_norm": False,
               "tie_embeddings": bool(config.get("tie_word_embeddings", True)), "logit_softcap": None,
               "bigram_embedding": False}
    return Gpt2Folder(path, options, int(config.get("vocab_size", 50257)), int(config.get("n_positions", 1024)),
                      tokenizer)


def unsupported(config: dict) -> str | None:
    """What in a GPT-2 config.json our model computes otherwise (None: nothing). Absent keys are GPT2Config's
    defaults: OpenAI's folders leave some out."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in IMPORTED_ACTIVATIONS:
        return f"activation_function={activation} (ours: {', '.join(IMPORTED_ACTIVATIONS)})"
    eps = config.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if not math.isclose(float(eps), LAYER_NORM_EPS, rel_tol=1e-6):
        return f"layer_norm_epsilon={eps} (ours: {LAYER_NORM_EPS})"
    n_embd, inner = config.get("n_embd", 768), config.get("n_inner")
    if inner is not None and inner != 4 * n_embd:
        return f"n_inner={inner} (ours: 4 x n_embd = {4 * n_embd})"
    for name, ours in EXACT_SETTINGS.items():
        if name in config and config[name] != ours:
            return f"{name}={json.dumps(config[name])} (ours: {json.dumps(ours)})"
    return None


# --------------------------------------------------------------------------------------------------- the weights
def gpt2_state_dict(folder: Gpt2Folder, expected: dict[str, torch.Size]) -> Tensors:
    """The folder's weights under our names, in fp32 on the CPU: exactly the tensors of `expected` (our model's
    state dict shapes, tied names included), each present, of its shape and finite."""
    theirs = read_weights(folder.path)
    if not any(name.startswith("transformer.") for name in theirs):  # saved from a bare GPT2Model
        theirs = {name if name == "lm_head.weight" else f"transformer.{name}": t for name, t in theirs.items()}
    theirs = {name: t for name, t in theirs.items() if not name.endswith(MASK_BUFFERS)}
    where = f"gpt_config.init_from={folder.path}"
    if folder.options["tie_embeddings"]:
        theirs.pop("lm_head.weight", None)  # tied: the token embedding under a second name, if saved at all
    ours: Tensors = {}
    for name in expected:
        source = "transformer.wte.weight" if name == "lm_head.weight" and folder.options["tie_embeddings"] else name
        if source not in theirs:
            raise UsageError(f"{where}: its weights have no {source}")
        tensor = theirs[source].to(torch.float32)
        if any(name.endswith(f"{conv}.weight") for conv in GPT2_CONV1D):
            tensor = tensor.t()  # Conv1D's [in, out] as a Linear's [out, in]
        if tensor.shape != expected[name]:
            raise UsageError(f"{where}: its {source} has shape {tuple(theirs[source].shape)}, the config.json's "
                             f"model needs {tuple(expected[name])} (transposed for a Conv1D)")
        if not torch.isfinite(tensor).all():
            raise UsageError(f"{where}: its {source} is not finite (NaN or infinite values)")
        ours[name] = tensor.contiguous()
    left_over = sorted(set(theirs) - set(expected))
    if left_over:
        raise UsageError(f"{where}: its weights have {len(left_over)} tensors a GPT-2 of its config.json has not "
                         f"({', '.join(left_over[:3])}{', ...' if len(left_over) > 3 else ''})")
    return ours


def read_weights(path: Path) -> Tensors:
    """Every tensor of the folder's safetensors: model.safetensors, or the shards its index names; anything else
    (no weights, only a pickled pytorch_model.bin, a damaged file) is a UsageError."""
    where = f"gpt_config.init_from={path}"
    if (path / WEIGHTS_FILE).is_file():
        files = [path / WEIGHTS_FILE]
    elif (path / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads((path / WEIGHTS_INDEX).read_text(encoding="utf-8"))["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"{where}: cannot read its {WEIGHTS_INDEX}: {first_line(e)}") from None
    else:
        pickled = " (only pytorch_model.bin, a pickle: save it with safe_serialization=True)" if (
            path / "pytorch_model.bin").exists() else ""
        raise UsageError(f"{where}: the folder has no {WEIGHTS_FILE}{pickled}")
    from safetensors.torch import load_file

    tensors: Tensors = {}
    for file in files:
        try:
            tensors.update(load_file(str(file), device="cpu"))
        except Exception as e:  # safetensors' SafetensorError (or an OSError) for a missing, truncated, damaged file
            raise UsageError(f"{where}: cannot read {file.name}: {first_line(e)}") from None
    return tensors
