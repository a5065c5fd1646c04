"""Example step "eval": scores the trained model on fresh data and writes metrics.json.

Usage: python -m lowtide.examples.eval --model DIR --out DIR [--rows 512]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from lowtide.examples.artifact_io import join, read_json, write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args()
    model = read_json(join(args.model, "model.json"))
    if model is None:
        print(f"eval: no model.json in {args.model}", file=sys.stderr)
        return 2
    w = model["w"]
    rng = random.Random(99)
    mse = 0.0
    for _ in range(args.rows):
        x1, x2 = rng.uniform(-1, 1), rng.uniform(-1, 1)
        y = 3 * x1 - 2 * x2 + 0.5
        mse += (w[0] * x1 + w[1] * x2 + w[2] - y) ** 2
    mse /= args.rows
    write_json(join(args.out, "metrics.json"), {"mse": mse, "steps": model["steps"], "w": w})
    print(f"eval: mse {mse:.6f} on {args.rows} rows (GPUs [{os.environ.get('CUDA_VISIBLE_DEVICES', '')}])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
