"""Write pages through SGLang's real HiCacheController in a process of its own, then exit.

    python tests/sglang/sgl_writer.py JOBS.json

``JOBS.json``: a list of ``{"yaml", "layout", "v1", "tokens", "seed", **make_engine kwargs}``; for each job an
engine is built, ``len(tokens) // page_size`` random pages (``random_pages(seed)``) are put into its host
pool and backed up through the controller's backup thread.  Prints one JSON list: the tokens each backup
reported stored.
"""

from __future__ import annotations

import json
import sys

import sgl_harness as h


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    done = []
    for job in jobs:
        tokens, seed = job.pop("tokens"), job.pop("seed")
        e = h.make_engine(job.pop("yaml"), **job)
        try:
            stored, _ = h.backup(e, tokens, h.random_pages(e, len(tokens) // e.page_size, seed))
        finally:
            e.close()
        done.append(stored)
    print(json.dumps(done))


if __name__ == "__main__":
    main()
