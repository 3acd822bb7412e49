#!/usr/bin/env python3
"""Model the tensor core's truncating sums in NumPy: the error and the one-sign bias of 3xFP16 GEMMs
under each promotion scheme, against an FP32 sgemv, before spending GPU time on one.

The model (Fasi et al.'s findings on V100 / T4 / A100, github north-numerical-computing/
tensor-cores-numerical-behavior; not yet checked bit for bit against an H100): products exact; each
instruction aligns its addends (the accumulator and its k products) to the largest in magnitude with no
guard digits, truncating toward zero; the exact sum is truncated to 24 significant bits. Promotion adds a
chain into FP32 registers, rounding to nearest.

    python scripts/tc_sum_model.py [--rows 4000] [--k 576,2304,4608]
"""

from __future__ import annotations

import argparse

import numpy as np


def trunc_sig(x: np.ndarray, bits: int = 24) -> np.ndarray:
    """``x`` truncated toward zero to ``bits`` significant bits."""
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(m * 2.0**bits) / 2.0**bits, e)


def tc_instr(acc: np.ndarray, prods: np.ndarray) -> np.ndarray:
    """One instruction per row: acc + sum(prods), every addend aligned to the largest and truncated."""
    adds = np.concatenate([acc[:, None], prods], axis=1)
    emax = np.frexp(np.abs(adds).max(axis=1))[1]
    q = np.ldexp(1.0, emax - 24)[:, None]
    return trunc_sig((np.sign(adds) * np.floor(np.abs(adds) / q) * q).sum(axis=1))


def split16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """3xFP16's split: the power-of-two scale that puts max |a| in [2^14, 2^15), hi and lo in float16."""
    s = 2.0 ** (14 - np.floor(np.log2(np.abs(a).max())))
    hi = (a * s).astype(np.float16).astype(np.float64)
    return hi, (a * s - hi).astype(np.float16).astype(np.float64), float(s)


def gemv(a: np.ndarray, b: np.ndarray, chain: int, separate: bool = False, k: int = 16) -> np.ndarray:
    """3xFP16 rows of ``a`` times ``b``: lo.hi, hi.lo, hi.hi per k step of ``k`` terms; the tensor-core
    sums promoted every ``chain`` instructions (0: every k step's three in one chain); ``separate``: the
    small products in a chain of their own."""
    (ah, al, sa), (bh, bl, sb) = split16(a), split16(b)
    total = np.zeros(a.shape[0], np.float32)
    big, small = np.zeros(a.shape[0]), np.zeros(a.shape[0])
    for j, k0 in enumerate(range(0, a.shape[1], k)):
        sl = slice(k0, k0 + k)
        if separate:
            small = tc_instr(tc_instr(small, al[:, sl] * bh[sl]), ah[:, sl] * bl[sl])
        else:
            big = tc_instr(tc_instr(big, al[:, sl] * bh[sl]), ah[:, sl] * bl[sl])
        big = tc_instr(big, ah[:, sl] * bh[sl])
        if (j + 1) % max(chain, 1) == 0:
            total = (total + small.astype(np.float32) + big.astype(np.float32)).astype(np.float32)
            big, small = np.zeros_like(big), np.zeros_like(small)
    total = (total + small.astype(np.float32) + big.astype(np.float32)).astype(np.float32)
    return total.astype(np.float64) / (sa * sb)


def stats(y: np.ndarray, ref: np.ndarray) -> str:
    bias = -np.mean((y - ref) * np.sign(ref)) / np.abs(ref).mean()
    return f"rel L2 {np.linalg.norm(y - ref) / np.linalg.norm(ref):.2e}   bias toward zero {bias:+.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--k", default="576,2304,4608", help="reduction lengths")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for kred in map(int, args.k.split(",")):
        a, b = rng.standard_normal((args.rows, kred)), rng.standard_normal(kred) * 0.05
        ref = a @ b
        print(f"K={kred}  FP32 sgemv{'':28s}{stats((a.astype(np.float32) @ b.astype(np.float32)), ref)}")
        for name, chain, sep in (("promoted every 2 stages (pi=2)", 8, False), ("every stage (pi=1)", 4, False),
                                 ("every k step", 1, False), ("pi=1, small products apart", 4, True)):
            print(f"K={kred}  3xFP16 {name:31s}{stats(gemv(a, b, chain, sep), ref)}")


if __name__ == "__main__":
    main()
