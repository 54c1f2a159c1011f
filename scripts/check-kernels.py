#!/usr/bin/env python3
"""Compiles mpx's own CUDA kernels (the KERNELS source in mpx-runtime/src/step/device/cuda.rs) with
NVRTC, as the runtime does at its first step on a GPU, and checks the PTX: every kernel present
and no fused multiply-add (the kernels must round as the CPU path does). Needs no GPU: only
NVIDIA's NVRTC wheel, which it installs into VENV.

Usage: scripts/check-kernels.py VENV   (e.g. the venv of scripts/make-cuda-root.sh)
"""

import ctypes
import os
import pathlib
import re
import subprocess
import sys


def main():
    venv = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mpx-cuda-venv")
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps",
                    "nvidia-cuda-nvrtc==13.0.88"], check=True)
    lib_dir = subprocess.run(
        [str(python), "-c",
         "import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))"],
        check=True, capture_output=True, text=True).stdout.strip()
    # NVRTC loads its builtins library by name: it must be on the loader's path
    if os.environ.get("MPX_NVRTC_CHILD") != "1":
        env = dict(os.environ, MPX_NVRTC_CHILD="1",
                   LD_LIBRARY_PATH=lib_dir + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
        os.execvpe(sys.executable, [sys.executable, __file__, str(venv)], env)

    root = pathlib.Path(__file__).resolve().parent.parent
    rust = (root / "mpx-runtime/src/step/device/cuda.rs").read_text()
    source = re.search(r'const KERNELS: &str = r#"(.*?)"#;', rust, re.S).group(1)
    names = re.findall(r'"(\w+)"', re.search(r"const NAMES: \[&str; \d+\] = \[(.*?)\];", rust, re.S).group(1))

    nvrtc = ctypes.CDLL(os.path.join(lib_dir, "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"mpx_step.cu", 0, None, None) == 0
    opts = [b"--fmad=false"]
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if status != 0:
        sys.exit(f"NVRTC failed ({status}):\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    ptx = ptx.value.decode()
    entries = set(re.findall(r"\.entry (\w+)\(", ptx))
    missing = [n for n in names if n not in entries]
    if missing:
        sys.exit(f"kernels named in cuda.rs but not in the PTX: {missing}")
    if re.search(r"\bfma\.", ptx):
        sys.exit("the PTX fuses a multiply and an add: the kernels would round unlike the CPU path")
    print(f"NVRTC compiled mpx's {len(entries)} kernels ({', '.join(sorted(entries))}); no fma")


if __name__ == "__main__":
    main()
