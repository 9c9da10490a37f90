"""Build and locate chaosgpu's CUDA injection library (loaded by libcuda via CUDA_INJECTION64_PATH).

This module owns building `cuda_inject/chaosgpu_cuda_inject.c` with gcc at use time (the
source ships; a built library is never committed or shipped), caching the result under the state
dir by the source's hash, finding the headers it needs (cuda.h and CUPTI's standalone headers:
a CUDA toolkit, or the nvidia-* wheels that torch installs) and libcupti, and the environment
that makes a CUDA program load it. It must not start anything but gcc.
"""

import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from chaosgpu import state
from chaosgpu.process.environment import helper_env

__all__ = ["SOURCE", "include_dirs", "cupti_library", "build", "environment"]

SOURCE = Path(__file__).resolve().parent / "cuda_inject" / "chaosgpu_cuda_inject.c"
HEADERS = ("cuda.h", "cupti_result.h", "cupti_driver_cbid.h", "cupti_runtime_cbid.h")


def _roots() -> list[str]:
    roots = [os.environ.get("CUDA_HOME") or "", os.environ.get("CUDA_PATH") or "",
             "/usr/local/cuda"]
    for site in sys.path:
        roots += glob.glob(os.path.join(site, "nvidia", "*"))
    return [r for r in dict.fromkeys(roots) if r and os.path.isdir(r)]


def include_dirs() -> list[str]:
    """Folders that together hold every header the library needs; raises naming what is missing."""
    candidates = []
    for root in _roots():
        candidates += [os.path.join(root, "include"),
                       os.path.join(root, "extras", "CUPTI", "include")]
    found: dict[str, str] = {}
    for folder in candidates:
        for header in HEADERS:
            if header not in found and os.path.isfile(os.path.join(folder, header)):
                found[header] = folder
    missing = [h for h in HEADERS if h not in found]
    if missing:
        raise RuntimeError(f"cannot build the CUDA injection library: {', '.join(missing)} not "
                           "found (install a CUDA toolkit with CUPTI, or torch's nvidia-* wheels; "
                           "or set CUDA_HOME)")
    return list(dict.fromkeys(found.values()))


def cupti_library() -> str | None:
    """Path of a libcupti shared library (toolkit or torch's wheels), or None when none is found."""
    patterns = []
    for root in _roots():
        patterns += [os.path.join(root, "lib", "libcupti.so*"),
                     os.path.join(root, "lib64", "libcupti.so*"),
                     os.path.join(root, "extras", "CUPTI", "lib64", "libcupti.so*")]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return path
    return None


def build(force: bool = False) -> Path:
    """Compile the library (once per source version) and return its path."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("cannot build the CUDA injection library: no gcc/cc on PATH")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    folder = state.state_dir() / "cuda_inject"
    folder.mkdir(mode=0o700, exist_ok=True)
    target = folder / f"chaosgpu_cuda_inject-{digest}.so"
    if target.exists() and not force:
        return target
    includes = [f"-I{d}" for d in include_dirs()]
    tmp = target.with_suffix(f".tmp{os.getpid()}.so")
    done = subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-Wall", *includes, "-o", str(tmp),
                           str(SOURCE), "-ldl", "-lpthread"], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env=helper_env())
    if done.returncode != 0:
        raise RuntimeError(f"gcc failed to build the CUDA injection library: "
                           f"{done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)
    return target


def environment(inject_dir: str) -> dict[str, str]:
    """The environment that makes a CUDA program load the library at cuInit and listen in
    `inject_dir`: CUDA_INJECTION64_PATH, CHAOSGPU_INJECT_DIR, CHAOSGPU_CUPTI_LIBRARY."""
    env = {"CUDA_INJECTION64_PATH": str(build()), "CHAOSGPU_INJECT_DIR": inject_dir}
    cupti = cupti_library()
    if cupti:
        env["CHAOSGPU_CUPTI_LIBRARY"] = cupti
    return env
