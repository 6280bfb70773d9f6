"""The components behind main.py, trainer.py, model.py and char_dataset.py (the files at the project's root):

    config        the training config: the components' dataclasses composed with the command line (Hydra)
    distributed   the torchrun job's process group, stopping together, never outliving the agent
    parallel      how the model is spread over the processes (DDP, FSDP) and its state in each form
    checkpoint    what a snapshot holds, when one is taken, writing and reading it (one file or DCP shards)
    storage       what a location is (local path or fsspec URL) and writes that survive a crash
    data          the encoded-corpus cache that char_dataset.py serves windows from
    reporting     logging, progress, metrics.jsonl and TensorBoard, loss plots, MLflow and W&B
    optim         the optimizer and its learning-rate schedule
    compat        every difference between the supported torch releases, in one place
    errors        the errors a user sees as one line

Importing the package imports nothing heavy: main.py imports mingpt.distributed.orphans before torch.
"""

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent  # relative paths in configs are taken from here, not the cwd
