"""Example step "prep": writes a deterministic synthetic regression data set as JSON shards.

y = 3·x1 − 2·x2 + 0.5 + noise, with a fixed seed, so every run gives the same data.
Usage: python -m lowtide.examples.prep --out DIR [--shards 4] [--rows 256] [--seed 7]
"""

from __future__ import annotations

import argparse
import random
import sys

from lowtide.examples.artifact_io import join, write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    for shard in range(args.shards):
        rows = []
        for _ in range(args.rows):
            x1, x2 = rng.uniform(-1, 1), rng.uniform(-1, 1)
            rows.append([x1, x2, 3 * x1 - 2 * x2 + 0.5 + rng.gauss(0, 0.05)])
        write_json(join(args.out, f"shard-{shard:03d}.json"), rows)
    write_json(join(args.out, "manifest.json"), {"shards": args.shards, "rows": args.rows, "seed": args.seed})
    print(f"prep: wrote {args.shards} shards of {args.rows} rows to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
