#!/usr/bin/env bash
# Builds mpx's GPU tests (tests/cuda.rs) and GPU benchmark (examples/bench_gpu.rs) here, where
# there is no GPU, and bundles them with what a GPU machine needs to run them: one folder and a
# tarball of it.
#
#   scripts/gpu-bundle.sh [OUT]        (OUT defaults to target/gpu-bundle)
#
# Environment: CUDA_ROOT (default /tmp/mpx-cuda; made with scripts/make-cuda-root.sh when
# missing), CARGO_TARGET_DIR (default target/cuda, so the CPU build in target/ is untouched).
#
# On the GPU machine: OUT/run-all.sh [RESULTS]  (see docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-target/gpu-bundle}
root=${CUDA_ROOT:-/tmp/mpx-cuda}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}

cargo fetch --quiet
[[ -x $root/bin/nvcc ]] || scripts/make-cuda-root.sh "$root"
export CUDA_ROOT=$root CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} PATH=$root/bin:$PATH

# The test binary's path, from cargo's own report of what it built.
tests=$(cargo test --release --features cuda --test cuda --no-run --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])
')
cargo build --release --features cuda --example bench_gpu
bench=$CARGO_TARGET_DIR/release/examples/bench_gpu
[[ -x $tests && -x $bench ]] || { echo "gpu-bundle.sh: the build did not produce both binaries" >&2; exit 1; }

dfdx=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 2 -type d -name dfdx-0.13.0 | head -n 1)
rm -rf "$out"
mkdir -p "$out/cuh"
# debug info stripped: the bundle travels (the release profile keeps line tables)
objcopy --strip-debug "$tests" "$out/mpx-cuda-tests"
objcopy --strip-debug "$bench" "$out/bench_gpu"
cp scripts/run-on-gpu.sh examples/gpu_peer.py "$out/"
cp "$dfdx"/src/tensor_ops/utilities/*.cuh "$out/cuh/"
echo "$root" > "$out/CUDA_ROOT"
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || echo unknown > "$out/COMMIT"

cat > "$out/run-all.sh" <<'SH'
#!/usr/bin/env bash
# On a GPU machine: mpx's GPU tests, then mpx's benchmark and PyTorch's AMP peer on the same GPU.
#   run-all.sh [RESULTS]   (RESULTS defaults to ./results; logs and summary.txt go there)
# Exits non-zero when a test failed; the benchmarks run either way.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
results=${1:-$here/results}
mkdir -p "$results"
root=$(cat "$here/CUDA_ROOT")
nvidia-smi > "$results/nvidia-smi.txt" 2>&1 || true
"$here/run-on-gpu.sh" "$root" "$here/mpx-cuda-tests" --test-threads=1 2>&1 | tee "$results/tests.log"
tests=${PIPESTATUS[0]}
"$here/run-on-gpu.sh" "$root" "$here/bench_gpu" --rounds "${ROUNDS:-21}" 2>&1 | tee "$results/bench.log"
python3 "$here/gpu_peer.py" --rounds "${ROUNDS:-21}" 2>&1 | tee "$results/peer.log"
python3 - "$results" <<'PY' | tee "$results/summary.txt"
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
def rows(name):
    out = {}
    for line in (d / name).read_text().splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["model"]] = r
    return out
mpx, torch = rows("bench.log"), rows("peer.log")
for model in ("mlp", "transformer"):
    m, t = mpx.get(model), torch.get(model)
    if not m:
        print(f"{model}: no mpx result")
        continue
    line = f"{model} on {m['gpu']}: mpx f16 {m['f16_ms']:.3f} ms = x{m['f16_ms'] / m['f32_ms']:.2f} of mpx f32 ({m['f32_ms']:.3f} ms)"
    if t:
        line += f"; PyTorch AMP {t['amp_f16_ms']:.3f} ms (x{t['amp_f16_ms'] / t['f32_ms']:.2f} of its f32); mpx f16 / PyTorch AMP = {m['f16_ms'] / t['amp_f16_ms']:.2f}"
    print(line)
PY
echo "tests exit status: $tests"
exit "$tests"
SH
chmod +x "$out/run-all.sh"
tar -C "$(dirname "$out")" -czf "$out.tar.gz" "$(basename "$out")"
echo "bundle: $out ($(du -sh "$out" | cut -f1)), $out.tar.gz"
