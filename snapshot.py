"""Inspect and convert snapshots (local paths are relative to the project folder; any fsspec URL works):

    python snapshot.py info snapshots/default/snapshot-000002000.pt      # one JSON object
    python snapshot.py info s3://bucket/run1/snapshot-000002000.pt
    python snapshot.py list s3://bucket/run1/                            # the snapshots there, newest first
    python snapshot.py export snapshots/default weights/ --which best    # the folder's best (trainer_config.keep_best)
    python snapshot.py consolidate snapshots/fsdp/snapshot-000000400.dcp one-file.pt
    python snapshot.py export snapshots/default/snapshot-000002000.pt weights/   # model.safetensors, config.json
    python snapshot.py export snapshots/default/snapshot-000002000.pt hf/ --format hf   # a transformers folder

`export --format hf` writes a folder that transformers' AutoModelForCausalLM and AutoTokenizer load offline
(GPT-2, GPT-NeoX, Arcee or Apertus, as the model options say; mingpt/checkpoint/hf_export.py).

Exit code 2 and one line on stderr for a snapshot that cannot be read or a location that cannot be used.
"""

from __future__ import annotations

from mingpt import startup

startup.pause_collection(__name__)  # until its imports are done (mingpt/startup.py)

import argparse
import json
import logging
import sys
from typing import Optional

from mingpt.checkpoint.store import SnapshotStore, best_snapshot_url, consolidate, export, read_snapshot, summary
from mingpt.errors import CorruptSnapshot, UsageError, describe
from mingpt.storage.locations import resolve_path
from model import GPTConfig

startup.resume_collection(__name__)


def list_snapshots(location: str) -> list[dict]:
    store = SnapshotStore(resolve_path(location))
    try:
        if store.fs.isfile(store.root):
            raise UsageError(f"{store.location} is a file, not a snapshot folder (snapshot.py info reads one)")
        entries = store.entries(missing_ok=False)
    except UsageError:
        raise
    except Exception as e:  # no permission, no credentials, an unreachable store, ...
        raise UsageError(f"cannot list {store.location}: {describe(e)}") from None
    best = store.best()
    rows = []
    for entry in entries:
        row = {"name": entry.name, "step": entry.step, "format": "sharded" if entry.sharded else "file",
               "bytes": store.size(entry), "url": store.url(entry.name)}
        if best is not None and best["snapshot"] == entry.name:
            row.update(best=True, val_loss=best["val_loss"])  # trainer_config.keep_best's: never pruned
        rows.append(row)
    return rows


def cli(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="snapshot.py", description="Inspect and convert mingpt-ddp snapshots.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="print one snapshot's summary as JSON")
    info.add_argument("source", metavar="path", help="snapshot file or folder of shards: local path or fsspec URL")
    listing = commands.add_parser("list", help="list the snapshots in a location, newest first")
    listing.add_argument("location", help="snapshot folder: local path or fsspec URL")
    merge = commands.add_parser("consolidate", help="write a snapshot (sharded or not) as a single file")
    merge.add_argument("source", help="snapshot: local path or fsspec URL")
    merge.add_argument("target", help="file (.pt) or folder to write it to")
    weights = commands.add_parser("export", help="write a snapshot's weights as safetensors, with a config.json")
    weights.add_argument("source", help="snapshot: local path or fsspec URL")
    weights.add_argument("target", help="folder to write model.safetensors and config.json to")
    weights.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                         help="safetensors: our names, our config (the default); hf: a Hugging Face transformers "
                              "folder (model, config, tokenizer) that AutoModelForCausalLM loads")
    for command in (info, merge, weights):
        command.add_argument("--which", choices=("best",), default=None,
                             help="best: the path is a snapshot folder; take its snapshot of the lowest validation "
                                  "loss (marked by trainer_config.keep_best)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if getattr(args, "which", None) == "best":  # info, consolidate, export: the folder's best snapshot
            args.source = best_snapshot_url(args.source)
        if args.command == "info":
            print(json.dumps(summary(read_snapshot(args.source))))
        elif args.command == "list":
            rows = list_snapshots(args.location)
            if not rows:
                print(f"no snapshot in {resolve_path(args.location).rstrip('/')}", file=sys.stderr)
            for row in rows:
                print(json.dumps(row))
        elif args.command == "consolidate":
            print(consolidate(args.source, args.target))
        elif args.format == "hf":
            from mingpt.checkpoint.hf_export import export_hf  # transformers: imported by this command alone

            print(export_hf(args.source, args.target, GPTConfig))
        else:
            print(export(args.source, args.target))
    except (UsageError, CorruptSnapshot) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
