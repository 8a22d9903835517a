#!/usr/bin/env python3
"""Lower bound of the GPU that GPU-sharing tasks leave idle, for each "openb" pod list.

Shares of one GPU (num_gpu == 1, gpu_milli < 1000) are items in bins of 1000 milli-GPU. However
they are placed, the GPUs holding them have at least OPT - sum(items) milli free, where OPT is the
fewest GPUs that can hold them all. We bound OPT from below by the linear relaxation of the
cutting-stock formulation (Gilmore and Gomory, 1961): one variable per way to fill one GPU
(a pattern: how many items of each size, summing to at most 1000), minimize the number of GPUs
such that every size is covered. The relaxation's optimum is at most OPT, so the waste it gives
is a floor for every placement policy, online or offline, that places every share of the list.

Usage: share-packing-floor.py DATA_DIR GPU_CAPACITY OUT.json [TRACE ...]
Needs scipy (scripts/placement-report.sh installs it into a virtual environment).
"""

import csv
import json
import os
import sys
from collections import Counter

import numpy as np
from scipy.optimize import linprog

WHOLE = 1000


def patterns(sizes, counts):
    """Every way to fill one GPU with items of `sizes` (largest first), at most `counts` each."""
    out, current = [], [0] * len(sizes)

    def walk(i, room):
        if i == len(sizes):
            if any(current):
                out.append(current[:])
            return
        k = 0
        while k * sizes[i] <= room and k <= counts[i]:
            current[i] = k
            walk(i + 1, room - k * sizes[i])
            k += 1
        current[i] = 0

    walk(0, WHOLE)
    return out


def floor(items):
    """(relaxed fewest GPUs, sum of items in GPUs) for a Counter of share sizes."""
    sizes = sorted(items, reverse=True)
    counts = [items[s] for s in sizes]
    cols = patterns(sizes, counts)
    a = np.array(cols, dtype=float).T
    res = linprog(np.ones(len(cols)), A_ub=-a, b_ub=-np.array(counts, dtype=float),
                  bounds=(0, None), method="highs")
    if res.status != 0:
        raise SystemExit(f"linear program failed: {res.message}")
    return res.fun, sum(s * c for s, c in items.items()) / WHOLE


def main():
    data, capacity, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    traces = sys.argv[4:]
    result = {}
    for trace in traces:
        path = os.path.join(data, "csv", f"openb_pod_list_{trace}.csv")
        with open(path) as f:
            rows = list(csv.DictReader(f))
        items = Counter(int(r["gpu_milli"]) for r in rows
                        if int(r["num_gpu"]) == 1 and int(r["gpu_milli"]) < WHOLE)
        demand = sum(int(r["num_gpu"]) * int(r["gpu_milli"]) for r in rows) / WHOLE
        gpus, used = floor(items) if items else (0.0, 0.0)
        result[trace] = {
            "trace_demand_pct": round(demand / capacity * 100, 2),
            "share_gpus_lp": round(gpus, 2),
            "share_milli_gpus": round(used, 2),
            "floor_pct": round((gpus - used) / capacity * 100, 2),
        }
        print(f"{trace}: shares need >= {gpus:.1f} GPUs for {used:.1f} GPUs of demand: "
              f"floor {result[trace]['floor_pct']:.2f} %", file=sys.stderr)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
