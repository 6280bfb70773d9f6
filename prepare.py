"""Build the encoded-corpus cache ahead of a job, so that its processes start on a ready one.

    python prepare.py                                              # the bundled data/input.txt
    python prepare.py data_config.path='/data/books/*.txt'         # any data_config setting, as main.py takes it
    python prepare.py data_config.path=s3://bucket/corpus/ data_config.cache_dir=/scratch/mingpt-cache
    python prepare.py --rebuild data_config.path=...               # encode again even though the cache is valid

The overrides (and presets) are main.py's; only data_config matters. A job with the same data_config then finds
the cache and only checks it. Run it on every node whose cache folder is its own (one run serves a shared one).
On a terminal a progress bar shows the two passes (scanning: the vocabulary, or the text a BPE is trained on;
then encoding); the last line says what is in the cache and the throughput reached.
"""

from __future__ import annotations

from mingpt import startup

startup.pause_collection(__name__)  # until its imports are done (mingpt/startup.py)

import sys
import time
from typing import Callable, Optional

from char_dataset import CharCorpus
from main import load_config
from mingpt.errors import UsageError
from mingpt.reporting.logs import setup_logging

startup.resume_collection(__name__)


def progress_bars() -> Optional[Callable[[str, int], Callable[[int], None]]]:
    """tqdm bars over the bytes of each pass, on a terminal; nothing otherwise (the log lines say enough)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    def bar(phase: str, total: int) -> Callable[[int], None]:
        shown = tqdm(total=total, desc=phase, unit="B", unit_scale=True, leave=False, dynamic_ncols=True)

        def tick(done: int) -> None:
            if shown.disable:  # closed: the pass is over
                return
            shown.update(done)
            if shown.n >= total:
                shown.close()

        return tick

    return bar


def prepare(args: list[str]) -> str:
    rebuild = "--rebuild" in args
    cfg = load_config([a for a in args if a != "--rebuild"]).data_config
    start = time.perf_counter()
    corpus = CharCorpus.load(cfg, build=True, progress=progress_bars(), rebuild=rebuild)
    seconds = time.perf_counter() - start
    tokens = corpus.tokens
    size = sum(s.size for s in tokens.sources)
    did = (f"encoded {size / 1e6:,.1f} MB in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):,.0f} MB/s)"
           if tokens.built_now else f"already built, checked in {seconds:.1f} s")
    return f"ready: {corpus.describe()}; {tokens.n_tokens * tokens.dtype.itemsize:,} bytes of {tokens.dtype}; {did}"


def main() -> int:
    setup_logging(0, None)
    try:
        print(prepare(sys.argv[1:]), flush=True)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
