#!/usr/bin/env bash
# Makes a CUDA "root" that dfdx 0.13's `cuda` feature (cudarc 0.9) builds and links against, on a
# machine with neither a GPU nor a CUDA toolkit (CI, and the machines mpx is developed on).
#
#   scripts/make-cuda-root.sh ROOT [VENV]
#
# ROOT  an absolute path. dfdx bakes ROOT/include into the binary (NVRTC compiles a few of its
#       kernels at run time with it), so the GPU machine needs the same path: scripts/run-on-gpu.sh
#       recreates it there.
# VENV  a Python virtual environment for NVIDIA's wheels (default: ROOT-venv).
#
# Needs `cargo fetch` first (it reads dfdx's and cudarc's sources from ~/.cargo/registry), python3
# with venv, gcc, and network access to PyPI. Then build with
#   CUDA_ROOT=ROOT CUDA_COMPUTE_CAP=90 PATH=ROOT/bin:$PATH cargo build --features cuda
set -euo pipefail

root=${1:?usage: make-cuda-root.sh ROOT [VENV]}
venv=${2:-$root-venv}
case $root in /*) ;; *) echo "ROOT must be an absolute path" >&2; exit 2 ;; esac

# 1. nvcc, the headers and the runtime from NVIDIA's wheels, pinned to CUDA 13.0: the GPU
#    machines' driver (580) loads PTX from nvcc 13.0 and refuses a newer one's.
wheels=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
)
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-deps "${wheels[@]}"
cu13=$("$venv/bin/python" - <<'PY'
import os, nvidia
print(os.path.join(list(nvidia.__path__)[0], "cu13"))
PY
)

registry_dir() { # crate-version -> its unpacked source in cargo's registry
    local d
    d=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 2 -type d -name "$1" | head -n 1)
    [[ -n $d ]] || { echo "$1 is not in cargo's registry: run \`cargo fetch\` first" >&2; exit 1; }
    echo "$d"
}
dfdx=$(registry_dir dfdx-0.13.0)
cudarc=$(registry_dir 'cudarc-0.9.*')

rm -rf "$root"
mkdir -p "$root/bin" "$root/include" "$root/lib64/stubs" "$root/stub-src"
ln -s "$cu13"/include/* "$root/include/"
# dfdx's run-time kernels include its own headers by name
cp "$dfdx"/src/tensor_ops/utilities/*.cuh "$root/include/"

# 2. nvcc must be called by its real path (it finds nvcc.profile beside itself); dfdx's build
#    script asks `nvidia-smi` for the compute capability even when CUDA_COMPUTE_CAP is set.
cat > "$root/bin/nvcc" <<SH
#!/bin/sh
exec "$cu13/bin/nvcc" "\$@"
SH
cat > "$root/bin/nvidia-smi" <<'SH'
#!/bin/sh
# stands in for the driver's tool at build time: H100 / H200 (compute capability 9.0)
printf 'compute_cap\n9.0\n'
SH
chmod +x "$root/bin/nvcc" "$root/bin/nvidia-smi"

# 3. Link-time stand-ins for the driver and the libraries cudarc links (no wheel ships a libcuda
#    stub): every function cudarc declares, under the library's SONAME (and symbol version where
#    the real library has one), so the binary asks for the real ones at run time. Never shipped.
make_stub() { # lib soname version-node cudarc-module
    local lib=$1 soname=$2 node=$3 module=$4 src=$root/stub-src/$1
    grep -oP 'pub fn \K[A-Za-z0-9_]+(?=\s*\()' "$cudarc/src/$module/sys.rs" | sort -u |
        sed 's/.*/int &(void) { return 999; }/' > "$src.c"
    local flags=(-shared -fPIC "-Wl,-soname,$soname")
    if [[ -n $node ]]; then
        printf '%s { global: *; };\n' "$node" > "$src.map"
        flags+=("-Wl,--version-script=$src.map")
    fi
    gcc "${flags[@]}" -o "$root/lib64/stubs/$lib.so" "$src.c"
}
make_stub libcuda libcuda.so.1 "" driver
make_stub libnvrtc libnvrtc.so.13 libnvrtc.so.13 nvrtc
make_stub libcublas libcublas.so.13 libcublas.so.13 cublas
make_stub libcublasLt libcublasLt.so.13 libcublasLt.so.13 cublaslt

echo "CUDA root: $root (nvcc $("$root/bin/nvcc" --version | grep -oP 'release \K[0-9.]+'))"
