#!/usr/bin/env bash
# Runs a binary built with scripts/make-cuda-root.sh on a GPU machine (NVIDIA driver 580, CUDA
# 13; no Rust toolchain or network needed there).
#
#   run-on-gpu.sh ROOT BINARY [ARGS...]
#
# ROOT is the path the binary was built with (CUDA_ROOT). dfdx compiles some kernels with NVRTC
# at run time, with ROOT/include baked in as their include path: it is recreated here from this
# machine's CUDA headers, with dfdx's own headers from cuh/ beside this script. The driver and
# the CUDA 13 libraries (NVRTC, cuBLAS) come from this machine: its driver, and PyTorch's CUDA
# wheels (or /usr/local/cuda).
set -euo pipefail

root=${1:?usage: run-on-gpu.sh ROOT BINARY [ARGS...]}
shift
bin=${1:?usage: run-on-gpu.sh ROOT BINARY [ARGS...]}
shift
here=$(cd "$(dirname "$0")" && pwd)

wheels=$(python3 -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true)
headers=""
for dir in "$wheels/include" /usr/local/cuda/include; do
    if [[ -f $dir/cuda_fp16.h ]]; then headers=$dir; break; fi
done
if [[ -z $headers ]]; then
    echo "run-on-gpu.sh: no CUDA headers (cuda_fp16.h) in PyTorch's wheels or /usr/local/cuda" >&2
    exit 1
fi

rm -rf "$root/include"
mkdir -p "$root/include"
ln -s "$headers"/* "$root/include/"
cp "$here"/cuh/*.cuh "$root/include/"

export LD_LIBRARY_PATH="$wheels/lib:/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$bin" "$@"
