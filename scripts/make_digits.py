#!/usr/bin/env python3
"""Writes data/digits.npz: the 1,797 8x8 handwritten digits shipped with scikit-learn.

Source: the test set of the UCI "Optical Recognition of Handwritten Digits" data set
(E. Alpaydin, C. Kaynak, 1998; CC BY 4.0), read from scikit-learn's bundled
sklearn/datasets/data/digits.csv.gz via sklearn.datasets.load_digits (no download).

Output arrays (read by memtrain's `data.source = "npz"`):
  x  float32 [1797, 8, 8]  pixel counts 0..16 divided by 16, so in [0, 1]
  y  int64   [1797]        the digit, 0..9

Usage (needs numpy and scikit-learn, e.g. in a throwaway venv):
  python3 -m venv /tmp/skvenv && /tmp/skvenv/bin/pip install scikit-learn
  /tmp/skvenv/bin/python scripts/make_digits.py [OUT]      # OUT defaults to data/digits.npz
"""
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "data" / "digits.npz"
    d = load_digits()
    images = np.asarray(d.images)
    target = np.asarray(d.target)
    assert images.shape == (1797, 8, 8), images.shape
    assert images.min() >= 0 and images.max() <= 16, (images.min(), images.max())
    x = np.ascontiguousarray(images / 16.0, dtype=np.float32)
    y = np.ascontiguousarray(target, dtype=np.int64)
    assert y.shape == (1797,) and set(np.unique(y)) == set(range(10))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compressed (deflate) members: tch's Tensor::read_npz reads them through the zip crate.
    np.savez_compressed(out, x=x, y=y)
    print(f"wrote {out}: x {x.dtype} {list(x.shape)}, y {y.dtype} {list(y.shape)}, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
