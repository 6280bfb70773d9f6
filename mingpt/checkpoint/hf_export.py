"""A snapshot as a Hugging Face transformers folder: `AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` load it offline, and the model computes the same function as ours.

    export_hf("snapshots/default/snapshot-000002000.pt", "hf-folder/")   # snapshot.py export --format hf

Each combination of model options maps to the transformers architecture that computes exactly that function, with
that architecture's own parameter names (checked against transformers 5.24's modeling files):

    positions=learned, norm=layernorm                 GPT-2        GPT2LMHeadModel
    positions=rotary,  norm=layernorm                 GPT-NeoX     GPTNeoXForCausalLM (sequential residual)
    positions=rotary,  norm=rmsnorm                   Arcee        ArceeForCausalLM (ungated MLP)
    positions=rotary,  norm=rmsnorm, qk_norm=true     Apertus      ApertusForCausalLM (per-head q/k RMSNorm)

Anything else has no exact equivalent and is refused in one line (a UsageError naming the option). The tokenizer is
the snapshot's (mingpt/data/tokenizer.py): a character one as tokenizers' WordLevel over the snapshot's vocabulary
(every character a token, decoded by joining; a character outside the vocabulary is an error, as in sample.py: there
is no spare id to map it to), a byte-level BPE as its own tokenizer.json. transformers and tokenizers are imported
here, on first use: a run that never exports never loads them.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mingpt.checkpoint import store
from mingpt.checkpoint.hf_names import ACTIVATIONS, GPT2_CONV1D
from mingpt.data.tokenizer import BpeTokenizer, snapshot_tokenizer, tokenizer_from_description
from mingpt.errors import UsageError
from mingpt.storage.locations import resolve_path

Tensors = dict[str, torch.Tensor]
# model.py's ModelConfig, or anything with its fields: handed down by the command (snapshot.py), as this package never
# imports the project's root
ModelConfig = Any
# The tokenizer's stand-in for an unknown character: not in the vocabulary, so WordLevel raises on one ("Missing
# [UNK] token from the vocabulary") instead of mapping it to an id that means another character.
UNKNOWN = "[UNK]"


@dataclass(frozen=True)
class Architecture:
    """A transformers architecture our model maps onto exactly: its config's model_type, its class, the weights
    under its own names (from our full tensors) and its config's settings."""

    model_type: str
    class_name: str
    weights: Callable[[Tensors, ModelConfig], Tensors]
    settings: Callable[[ModelConfig], dict]


# --------------------------------------------------------------------------------------------- which architecture
def architecture(cfg: ModelConfig) -> Architecture:
    """The architecture for a model config; one with no exact equivalent is a UsageError naming the option."""
    why = refusal(cfg)
    if why is not None:
        raise UsageError(f"cannot export as a Hugging Face model: {why}; `snapshot.py export` without --format hf "
                         f"writes its weights as safetensors")
    if cfg.positions == "learned":
        return Architecture("gpt2", "GPT2LMHeadModel", gpt2_weights, gpt2_settings)
    if cfg.norm == "layernorm":
        return Architecture("gpt_neox", "GPTNeoXForCausalLM", neox_weights, neox_settings)
    if cfg.qk_norm:
        return Architecture("apertus", "ApertusForCausalLM", apertus_weights, apertus_settings)
    return Architecture("arcee", "ArceeForCausalLM", arcee_weights, arcee_settings)


def refusal(cfg: ModelConfig) -> str | None:
    """Why no transformers architecture computes this model's function (None: one does). zero_init_proj (only how
    training starts) and attention (the same function either way) do not matter."""
    if cfg.bigram_embedding:
        return "gpt_config.bigram_embedding=true (no architecture embeds pairs of tokens)"
    if cfg.logit_softcap is not None:
        return f"gpt_config.logit_softcap={cfg.logit_softcap} (no architecture with our other options caps logits)"
    if cfg.norm == "rmsnorm" and cfg.positions == "learned":
        return "gpt_config.norm=rmsnorm with positions=learned (no architecture has both; rotary positions have one)"
    if cfg.qk_norm and (cfg.positions, cfg.norm) != ("rotary", "rmsnorm"):
        return (f"gpt_config.qk_norm=true with positions={cfg.positions}, norm={cfg.norm} (the one architecture "
                f"with per-head q/k RMSNorm and an ungated MLP, Apertus, has rotary positions and RMSNorm)")
    if cfg.qk_norm and cfg.bias:
        return "gpt_config.qk_norm=true with bias=true (Apertus, the architecture for qk_norm, has no MLP biases)"
    return None


# --------------------------------------------------------------------------------------------- shared pieces
def norm_eps(cfg: ModelConfig) -> float:
    """The epsilon of our norms, as the model config gives it to them: nn.LayerNorm's 1e-5; nn.RMSNorm's None,
    which torch takes as the input dtype's machine epsilon (fp32's here: the export is fp32)."""
    eps = cfg.norm_eps
    return float(torch.finfo(torch.float32).eps if eps is None else eps)


def common_settings(cfg: ModelConfig) -> dict:
    """What every architecture's config gets: the shape, and no special tokens (a character vocabulary has none;
    the architectures' defaults name ids of their own vocabularies)."""
    return {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": None,
            "eos_token_id": None, "pad_token_id": None}


def rope(cfg: ModelConfig, **more: Any) -> dict:
    """Plain RoPE over the whole head at our base (transformers 5's rope_parameters)."""
    return {"rope_type": "default", "rope_theta": float(cfg.rope_base), **more}


def linear(ours: Tensors, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear's weight and bias; zeros for a bias our model does not have (bias=false) where the target has one."""
    weight = ours[f"{name}.weight"]
    bias = ours.get(f"{name}.bias")
    return weight, torch.zeros(weight.shape[0], dtype=weight.dtype) if bias is None else bias


def layer_norm(ours: Tensors, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A LayerNorm's gain and bias; zeros for the bias that bias=false leaves out (the targets always have one)."""
    weight = ours[f"{name}.weight"]
    return weight, ours.get(f"{name}.bias", torch.zeros_like(weight))


def embeddings(ours: Tensors, cfg: ModelConfig, embedding: str, head: str) -> Tensors:
    """The token embedding under `embedding`, and an untied output head under `head` (a tied one is the embedding:
    stored once, as transformers saves it; the config's tie_word_embeddings ties it again on loading)."""
    out = {embedding: ours["transformer.wte.weight"]}
    if not cfg.tie_embeddings:
        out[head] = ours["lm_head.weight"]
    return out


# --------------------------------------------------------------------------------------------- GPT-2
def gpt2_settings(cfg: ModelConfig) -> dict:
    """GPT-2 as ours: our activation (exact or tanh GELU, relu2), our epsilon, 1/sqrt(head_dim) attention scaling
    alone, our dropout in the same three places (attention weights, residual branches, embeddings)."""
    return {"n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": 4 * cfg.n_embd, "activation_function": ACTIVATIONS[cfg.activation],
            "layer_norm_epsilon": norm_eps(cfg), "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False}


def gpt2_weights(ours: Tensors, cfg: ModelConfig) -> Tensors:
    """Our names are GPT-2's; its Conv1D layers store weights as [in, out], so our Linear weights are transposed,
    and it always has biases (zeros where we have none). c_attn's q, k, v order and head layout are ours."""
    out = {"transformer.wpe.weight": ours["transformer.wpe.weight"],
           **embeddings(ours, cfg, "transformer.wte.weight", "lm_head.weight")}
    norms = ["transformer.ln_f"]
    for i in range(cfg.n_layer):
        block = f"transformer.h.{i}"
        norms += [f"{block}.ln_1", f"{block}.ln_2"]
        for conv in GPT2_CONV1D:
            weight, bias = linear(ours, f"{block}.{conv}")
            out[f"{block}.{conv}.weight"], out[f"{block}.{conv}.bias"] = weight.t(), bias
    for norm in norms:
        out[f"{norm}.weight"], out[f"{norm}.bias"] = layer_norm(ours, norm)
    return out


# --------------------------------------------------------------------------------------------- GPT-NeoX
def neox_settings(cfg: ModelConfig) -> dict:
    """GPT-NeoX as ours: a sequential residual (x + attn, then + mlp: use_parallel_residual false), RoPE over the
    whole head at our base, our activation and epsilon, our dropout on attention weights, residual branches and
    embeddings (hidden_dropout)."""
    return {"hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "intermediate_size": 4 * cfg.n_embd, "hidden_act": ACTIVATIONS[cfg.activation],
            "max_position_embeddings": cfg.block_size, "layer_norm_eps": norm_eps(cfg),
            "use_parallel_residual": False, "rope_parameters": rope(cfg, partial_rotary_factor=1.0),
            "attention_bias": cfg.bias, "attention_dropout": cfg.dropout, "hidden_dropout": cfg.dropout}


def neox_qkv(fused: torch.Tensor, n_head: int) -> torch.Tensor:
    """Our c_attn rows [q of every head; k ...; v ...] in GPT-NeoX's order, head by head: [q_0, k_0, v_0, q_1, ...]
    (it views the projection as (heads, 3 * head_dim) and splits each head's part). Works for weights and biases."""
    q, k, v = (part.reshape(n_head, -1, *part.shape[1:]) for part in fused.chunk(3, dim=0))
    return torch.cat((q, k, v), dim=1).reshape(fused.shape)


def neox_weights(ours: Tensors, cfg: ModelConfig) -> Tensors:
    """Renamed; c_attn reordered head by head (`neox_qkv`). Both rotate q and k the same way: pair (i, i + d/2)
    turns by position * base^(-2i/d) (our `rotate`, its rotate_half), so no rows need permuting. The MLP and the
    norms always have biases (zeros where we have none); the attention's follow attention_bias."""
    out = embeddings(ours, cfg, "gpt_neox.embed_in.weight", "embed_out.weight")  # the Hub's name; loads as lm_head
    final = "gpt_neox.final_layer_norm"
    out[f"{final}.weight"], out[f"{final}.bias"] = layer_norm(ours, "transformer.ln_f")
    for i in range(cfg.n_layer):
        ours_, theirs = f"transformer.h.{i}", f"gpt_neox.layers.{i}"
        renamed = {"attn.c_attn": "attention.query_key_value", "attn.c_proj": "attention.dense",
                   "mlp.c_fc": "mlp.dense_h_to_4h", "mlp.c_proj": "mlp.dense_4h_to_h"}
        for mine, name in renamed.items():
            weight, bias = linear(ours, f"{ours_}.{mine}")
            if mine == "attn.c_attn":
                weight, bias = neox_qkv(weight, cfg.n_head), neox_qkv(bias, cfg.n_head)
            out[f"{theirs}.{name}.weight"] = weight
            if cfg.bias or mine.startswith("mlp"):
                out[f"{theirs}.{name}.bias"] = bias
        for mine, name in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[f"{theirs}.{name}.weight"], out[f"{theirs}.{name}.bias"] = layer_norm(ours, f"{ours_}.{mine}")
    return out


# --------------------------------------------------------------------------------------------- Arcee and Apertus
def arcee_settings(cfg: ModelConfig) -> dict:
    """Arcee as ours: RMSNorm at our epsilon, plain RoPE, an ungated MLP (up -> activation -> down), our biases;
    its only dropout is on attention weights (it has none on residual branches or embeddings)."""
    return {**llama_like_settings(cfg), "attention_bias": cfg.bias, "mlp_bias": cfg.bias}


def apertus_settings(cfg: ModelConfig) -> dict:
    """Apertus as Arcee, plus per-head q and k RMSNorm before RoPE (as ours), at the same epsilon (ours is the
    same function, F.rms_norm without eps); its MLP has no biases (refused with bias=true)."""
    return {**llama_like_settings(cfg), "attention_bias": False}


def llama_like_settings(cfg: ModelConfig) -> dict:
    """What Arcee and Apertus share: Llama's config with as many key/value heads as heads (no grouped queries)."""
    return {"hidden_size": cfg.n_embd, "intermediate_size": 4 * cfg.n_embd, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
            "head_dim": cfg.n_embd // cfg.n_head, "hidden_act": ACTIVATIONS[cfg.activation],
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": norm_eps(cfg), "rope_parameters": rope(cfg),
            "attention_dropout": cfg.dropout}


def arcee_weights(ours: Tensors, cfg: ModelConfig) -> Tensors:
    """Llama's names, the ungated MLP's up_proj and down_proj (`llama_like_weights`)."""
    return llama_like_weights(ours, cfg, ("input_layernorm", "post_attention_layernorm"))


def apertus_weights(ours: Tensors, cfg: ModelConfig) -> Tensors:
    """Arcee's layout under Apertus' norm names, and gains of ones for the q/k norms (ours have no parameters)."""
    out = llama_like_weights(ours, cfg, ("attention_layernorm", "feedforward_layernorm"))
    ones = torch.ones(cfg.n_embd // cfg.n_head, dtype=out["model.norm.weight"].dtype)
    for i in range(cfg.n_layer):
        out[f"model.layers.{i}.self_attn.q_norm.weight"] = ones.clone()
        out[f"model.layers.{i}.self_attn.k_norm.weight"] = ones.clone()
    return out


def llama_like_weights(ours: Tensors, cfg: ModelConfig, norm_names: tuple[str, str]) -> Tensors:
    """Llama's names with an ungated MLP: c_attn split into q_proj, k_proj, v_proj (same head layout), c_proj as
    o_proj, c_fc as up_proj, the MLP's c_proj as down_proj; biases only where we have them."""
    out = {**embeddings(ours, cfg, "model.embed_tokens.weight", "lm_head.weight"),
           "model.norm.weight": ours["transformer.ln_f.weight"]}
    for i in range(cfg.n_layer):
        mine, theirs = f"transformer.h.{i}", f"model.layers.{i}"
        weights, biases = (tensor.chunk(3, dim=0) for tensor in linear(ours, f"{mine}.attn.c_attn"))
        parts = {f"{theirs}.self_attn.{name}": (weight, bias)
                 for name, weight, bias in zip(("q_proj", "k_proj", "v_proj"), weights, biases)}
        parts[f"{theirs}.self_attn.o_proj"] = linear(ours, f"{mine}.attn.c_proj")
        parts[f"{theirs}.mlp.up_proj"] = linear(ours, f"{mine}.mlp.c_fc")
        parts[f"{theirs}.mlp.down_proj"] = linear(ours, f"{mine}.mlp.c_proj")
        for name, (weight, bias) in parts.items():
            out[f"{name}.weight"] = weight
            if cfg.bias:
                out[f"{name}.bias"] = bias
        out[f"{theirs}.{norm_names[0]}.weight"] = ours[f"{mine}.ln_1.weight"]
        out[f"{theirs}.{norm_names[1]}.weight"] = ours[f"{mine}.ln_2.weight"]
    return out


# --------------------------------------------------------------------------------------------- the files
def config_json(arch: Architecture, cfg: ModelConfig, dtype: torch.dtype) -> bytes:
    """config.json, built by transformers' own config class (so it checks the settings and names the version); every
    value written, not only those that differ from this release's defaults, which another release may change."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(arch.model_type, **common_settings(cfg), **arch.settings(cfg))
    config.architectures = [arch.class_name]
    config.dtype = str(dtype).removeprefix("torch.")
    return config.to_json_string(use_diff=False).encode()


def generation_config_json() -> bytes:
    """generation_config.json: sample.py's default sampling (temperature 0.8, top_k 40; sample_cfg.yaml). No length:
    a max_length here draws a warning at every generate(max_new_tokens=...), and keeping prompt plus new tokens
    within block_size is the caller's part (docs/snapshots.md)."""
    from transformers import GenerationConfig

    generation = GenerationConfig(do_sample=True, temperature=0.8, top_k=40, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None)
    return generation.to_json_string(use_diff=True).encode()


def tokenizer_files(description: dict | str, block_size: int) -> dict[str, bytes]:
    """The tokenizer's files (tokenizer.json, tokenizer_config.json) from the snapshot's tokenizer description (a
    string: the characters of a snapshot from before descriptions). Characters: ids in the order of the snapshot's
    vocabulary string (sample.py's), every character its own token (newlines and spaces included, nothing
    normalised), decoded by joining. A byte-level BPE: its own tokenizer.json, which encodes as sample.py does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ours = tokenizer_from_description(description)
    if isinstance(ours, BpeTokenizer):
        tokenizer = ours.hf_tokenizer()
    else:
        tokenizer = Tokenizer(models.WordLevel({char: i for i, char in enumerate(ours.chars)}, unk_token=UNKNOWN))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one per character
        tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False,
                                   model_max_length=block_size)
    with tempfile.TemporaryDirectory() as folder:  # save_pretrained writes a local folder; the target may be a URL
        files = {os.path.basename(name): Path(name).read_bytes() for name in fast.save_pretrained(folder)
                 if os.path.isfile(name)}
    settings = json.loads(files["tokenizer_config.json"])
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"  # what transformers 4 calls the class 5 names otherwise
    files["tokenizer_config.json"] = json.dumps(settings, indent=2).encode()
    return files


def hf_files(snapshot: dict, config_type: Callable[..., ModelConfig]) -> dict[str, bytes]:
    """Every file of the export of a verified snapshot, by name; `config_type` builds a model config (GPTConfig)."""
    from safetensors.torch import save as safetensors_bytes

    cfg = model_config(snapshot, config_type)
    arch = architecture(cfg)  # before the tensors: a refused folder of shards is not read
    ours = store.model_tensors(snapshot)
    # Copies: safetensors refuses tensors that share memory, as q_proj, k_proj and v_proj (views of c_attn) do
    weights = {name: tensor.contiguous().clone() for name, tensor in arch.weights(ours, cfg).items()}
    metadata = {"format": "pt", "mingpt_ddp_step": str(snapshot["progress"]["step"]),
                "mingpt_ddp_weights_sha256": store.weights_sha256(ours)}  # which snapshot these weights are
    return {"model.safetensors": safetensors_bytes(weights, metadata=metadata),
            "config.json": config_json(arch, cfg, next(iter(weights.values())).dtype),
            "generation_config.json": generation_config_json(),
            **tokenizer_files(snapshot_tokenizer(snapshot), cfg.block_size)}


def model_config(snapshot: dict, config_type: Callable[..., ModelConfig]) -> ModelConfig:
    """The snapshot's model config (options it predates at GPT-2's choice), as sample.py builds its model from."""
    try:
        return config_type(**store.with_option_defaults(snapshot["model_config"]))
    except TypeError as e:  # a field this code does not know: a snapshot of a newer mingpt-ddp
        raise UsageError(f"the snapshot's model config does not fit this code: {e}") from None


# The optional packages the export imports (on first use), and the project's file that installs them (README)
PACKAGES = ("transformers", "tokenizers")
REQUIREMENTS = "requirements-hf.txt"


def require_packages() -> None:
    """transformers and tokenizers, found (not imported): a missing one is a UsageError naming the install command,
    before the snapshot is read."""
    import importlib.util

    missing = next((name for name in PACKAGES if importlib.util.find_spec(name) is None), None)
    if missing is not None:
        raise UsageError(f"snapshot.py export --format hf needs the {missing} package: pip install -r {REQUIREMENTS}")


def export_hf(source: str, target: str, config_type: Callable[..., ModelConfig]) -> str:
    """Snapshot `source` (a file or a folder of shards, a local path or fsspec URL) as a transformers folder
    `target`: model.safetensors, config.json, generation_config.json and the tokenizer. Each file is written as
    store.export writes its own (atomically; any fsspec URL). `config_type` builds the model config from the
    snapshot's (model.GPTConfig). Returns where it went."""
    require_packages()
    files = hf_files(store.read_snapshot(source), config_type)
    output = store.SnapshotStore(resolve_path(target))
    for name, data in files.items():
        store.write_output(output, name, data)
    return output.location
