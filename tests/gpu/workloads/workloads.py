#!/usr/bin/env python3
"""The acceptance suite's PyTorch workloads. Each prints one JSON line on stdout.

  workloads.py matmul  --seconds S [--size N]   bf16 matmul throughput (TFLOP/s)
  workloads.py latency --seconds S [--size N]   one small bf16 matmul at a time: p50/p99 (us)
  workloads.py hold    --gib G --seconds S      holds G GiB and keeps the GPU busy; exit 3 on a
                                                CUDA error (e.g. MPS terminate_client)
  workloads.py mem     [--max N]                1 GiB tensors until refused (no nvcc needed)
"""

import argparse
import json
import sys
import time


def torch_cuda():
    import torch  # noqa: PLC0415 (imported late: the suite checks for it first)

    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA device"}))
        sys.exit(2)
    return torch


def operands(torch, n, warmup):
    """Two random n x n bf16 matrices on the GPU, multiplied `warmup` times first."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ b
    torch.cuda.synchronize()
    return a, b


def matmul(args):
    torch = torch_cuda()
    n = args.size
    a, b = operands(torch, n, 3)
    done = 0
    began = time.time()
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        done += 10
    took = time.perf_counter() - start
    # Wall-clock bounds of the timed loop, so that two workloads can be seen to overlap.
    print(json.dumps({"tflops": round(2 * n**3 * done / took / 1e12, 1), "seconds": round(took, 2),
                      "began": round(began, 3), "ended": round(time.time(), 3)}))


def latency(args):
    torch = torch_cuda()
    a, b = operands(torch, args.size, 20)
    samples = []
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()

    def pct(p):
        return round(samples[min(len(samples) - 1, int(p * len(samples)))], 1)

    print(json.dumps({"p50_us": pct(0.50), "p99_us": pct(0.99), "samples": len(samples)}))


def hold(args):
    torch = torch_cuda()
    try:
        block = torch.empty(args.gib << 30, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        a = torch.randn(1024, 1024, device="cuda")
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            time.sleep(0.05)
        print(json.dumps({"held_gib": args.gib, "ok": True}))
    except RuntimeError as e:
        print(json.dumps({"held_gib": args.gib, "ok": False, "error": str(e)[:300]}))
        sys.exit(3)


def mem(args):
    torch = torch_cuda()
    got = []
    refused = "none"
    while len(got) < args.max:
        try:
            got.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
        except RuntimeError as e:
            refused = str(e).splitlines()[0][:120]
            break
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"api": "torch", "allocated_gib": len(got), "refused_with": refused,
                      "free": free, "total": total}))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("matmul")
    p.add_argument("--seconds", type=float, default=3)
    p.add_argument("--size", type=int, default=8192)
    p = sub.add_parser("latency")
    p.add_argument("--seconds", type=float, default=3)
    p.add_argument("--size", type=int, default=2048)
    p = sub.add_parser("hold")
    p.add_argument("--gib", type=int, required=True)
    p.add_argument("--seconds", type=float, default=20)
    p = sub.add_parser("mem")
    p.add_argument("--max", type=int, default=256)
    args = parser.parse_args()
    {"matmul": matmul, "latency": latency, "hold": hold, "mem": mem}[args.cmd](args)


if __name__ == "__main__":
    main()
