#!/usr/bin/env bash
# Tessera's GPU acceptance suite (docs/cdi.md, "GPU acceptance suite").
#
#   tests/gpu/run.sh [--hami-library PATH] [--plugin-arg FLAG]... [suite.py flags]
#
# Runs by hand on a machine with an NVIDIA GPU, as root (mount namespaces, a pod-like cgroup,
# MPS daemons), with CUDA, Python 3 and PyTorch there (nvcc too, for the CUDA memory probe).
# Where there is no GPU it prints "SKIP: no NVIDIA GPU ..." and exits 0.
#
# Environment:
#   TESSERA_BIN_DIR      release binaries: tessera, tessera-kubelet-plugin, tessera-mps,
#                        tessera-fake-apiserver, tessera-fake-kubelet [default: <repo>/.gpu-bin]
#   TESSERA_GPU_RESULTS  where results.md, results.json and logs/ go
#                        [default: tests/gpu/results/<UTC time>]
#   NVIDIA_SMI           the nvidia-smi to ask for GPUs [default: nvidia-smi]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
nvidia_smi=${NVIDIA_SMI:-nvidia-smi}

skip() {
    echo "SKIP: $*"
    exit 0
}

fail() {
    echo "tests/gpu/run.sh: $*" >&2
    exit 2
}

if ! command -v "$nvidia_smi" >/dev/null 2>&1; then
    skip "no NVIDIA GPU here ($nvidia_smi not found); the GPU acceptance suite needs one"
fi
if ! "$nvidia_smi" -L 2>/dev/null | grep -q '^GPU '; then
    skip "no NVIDIA GPU here ($nvidia_smi lists none); the GPU acceptance suite needs one"
fi
[ "$(id -u)" -eq 0 ] || fail "run it as root: it makes mount namespaces, a pod cgroup and MPS daemons"
command -v python3 >/dev/null 2>&1 || fail "python3 is missing"
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
    fail "PyTorch with CUDA is missing (python3 -c 'import torch')"
command -v unshare >/dev/null 2>&1 || fail "unshare (util-linux) is missing"
# The step with two share pods of different users runs one of them as uid 1000 through setpriv.
command -v setpriv >/dev/null 2>&1 || fail "setpriv (util-linux) is missing"

bin_dir=${TESSERA_BIN_DIR:-$repo/.gpu-bin}
for tool in tessera tessera-kubelet-plugin tessera-mps tessera-fake-apiserver tessera-fake-kubelet; do
    [ -x "$bin_dir/$tool" ] || fail "$bin_dir/$tool is missing; build with: cargo build --release --workspace --bins, then copy (stripped) into $bin_dir"
done

out=${TESSERA_GPU_RESULTS:-$here/results/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
work=$(mktemp -d /tmp/tessera-gpu.XXXXXX)
mps_root=$(mktemp -d /run/tessera-gpu.XXXXXX 2>/dev/null || mktemp -d /dev/shm/tessera-gpu.XXXXXX)
cleanup() {
    rm -rf "$work"
    rm -rf "$mps_root"
}
trap cleanup EXIT

if command -v nvcc >/dev/null 2>&1; then
    nvcc -O2 -o "$out/mem_probe" "$here/workloads/mem_probe.cu" -lcuda >"$out/nvcc.log" 2>&1 ||
        echo "nvcc failed (see $out/nvcc.log); the memory steps use PyTorch's allocator"
else
    echo "no nvcc: the memory steps use PyTorch's allocator"
fi

gpu=$("$nvidia_smi" --query-gpu=name,driver_version --format=csv,noheader | head -n 1)
cuda=$("$nvidia_smi" | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)
torch=$(python3 -c 'import torch; print(torch.__version__)')
facts="$gpu, CUDA $cuda, PyTorch $torch, $(date -u +%Y-%m-%dT%H:%MZ)"

# Not exec: the EXIT trap removes the scratch directories once the suite is done.
python3 "$here/suite.py" --bin-dir "$bin_dir" --out "$out" --work "$work" \
    --mps-root "$mps_root" --facts "$facts" "$@"
