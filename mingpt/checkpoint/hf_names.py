"""What the Hugging Face export (hf_export.py) and the GPT-2 import (hf_import.py) share: one table each, read one
way by the export and the other by the import. No transformers here: a run that starts from a folder imports this
module, and neither transformers nor the export."""

from __future__ import annotations

# Our activations under their names in transformers' ACT2FN: "gelu" is torch's exact (erf) GELU, which nn.GELU()
# computes by default; "gelu_pytorch_tanh" is nn.GELU(approximate="tanh") itself (our gelu_tanh); "relu2" is relu(x)^2.
ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu2": "relu2"}
# GPT-2's layers that are Conv1D, under the names of our Linear layers (every other GPT-2 name is ours as it is):
# Conv1D stores its weight as [in, out], a Linear as [out, in].
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
