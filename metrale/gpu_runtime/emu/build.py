"""Building a `kernels/*.cu` file into a shared library the EmuBackend can launch.

Steps, for one `.cu` file:
  1. entry points: `extern "C" __global__` functions of the preprocessed source (`g++ -E`
     with the stub CUDA headers), so macro-generated kernels are found too, with the line
     that declares each and its `__launch_bounds__` (the shim defines the attribute away;
     the launch check compares a launch's block with it);
  2. one rewrite: `extern __shared__ T name[];` (dynamic shared memory, which has no C++
     spelling) becomes `T *const name = (T *)::emu::dynamic_smem();` on the same line, so
     file and line numbers in diagnostics stay those of the `.cu` file;
  3. a trailer exporting, per entry point, `emu_launch__<name>` (cuLaunchKernel-style
     `void **args`), `emu_sig__<name>` (the C parameter types, for the launch check) and
     `emu_bounds__<name>` (the __launch_bounds__ values, 0 where there are none);
  4. `g++ -include shim.h` into `<cache>/<module>-<hash>[-asan|-check].so`, the hash
     covering the source, every header in kernels/, the emulator's own headers, the flags
     and the compiler's version. A finished library is reused by every later process.

Flavours: "plain"; "asan" (AddressSanitizer + UBSan); "check", instrumented for the
launch-time checks and counters of check.h / counters.h: compiled with
`-fsanitize=thread` (every load and store calls a hook, hooks.h, which is the whole runtime:
no libtsan is linked) and `-fno-tree-sra` (a 16-byte vector access stays one access).
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...errors import KernelError
from ..cxx import cache_root, compiler, compiler_version, run_build

EMU_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = EMU_DIR / "include"
SHIM = EMU_DIR / "shim.h"

# What the feasibility study found to keep kernel semantics (EMULATOR_NOTES.md): IEEE
# arithmetic without contraction, aliasing through reinterpret_cast allowed, a real fmaf.
BASE_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-shared", "-fvisibility=hidden",
              "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
              "-Wno-attributes")
ARCH_FLAGS = ("-mfma",) if platform.machine() in ("x86_64", "AMD64") else ()
# -g1 (line tables only) in both instrumented flavours: enough for ASan's and the checks'
# file:line (test_asan_names_the_kernel_line, test_emu_checks.py); full -g made each build
# 1.4-1.7x slower to compile (attention.cu under ASan 15.4 s vs 9.0, under the checks 4.9 s
# vs 3.5), and CI's cold instrumented runs are mostly these builds
SANITIZE_FLAGS = ("-g1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                  "-fno-omit-frame-pointer")
CHECK_FLAGS = ("-g1", "-DEMU_CHECK=1", "-fsanitize=thread",
               "--param=tsan-instrument-func-entry-exit=0", "-fno-tree-sra")
FLAVOURS = ("plain", "asan", "check")

_DYN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?"
    r"(?P<type>[A-Za-z_][\w\s]*?)\s+(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+')
_NAME = re.compile(r"\s*(?P<name>[A-Za-z_]\w*)\s*\(")
_BOUNDS = re.compile(r"__launch_bounds__\s*\(")
_MARKER = re.compile(r'^# (\d+) "([^"]*)"', re.M)


def _includes(path: Path, header_dirs) -> list[str]:
    """The `.cu` file's directory, then `header_dirs` (kernels/), then the stub headers."""
    return [f"-I{d}" for d in (path.parent, *header_dirs, INCLUDE_DIR)]


def _balanced(text: str, i: int) -> int:
    """Index just past the parenthesis that closes the one before `text[i]`."""
    depth = 1
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return i


def _split_args(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


@dataclass(frozen=True)
class EntryPoint:
    """An `extern "C" __global__` kernel: where it is declared and its launch bounds
    (`max_threads`, `min_blocks`: C++ expressions after the preprocessor, or None)."""
    name: str
    file: str
    line: int
    max_threads: str | None
    min_blocks: str | None


def entry_info(path: Path, header_dirs=()) -> list[EntryPoint]:
    """The entry points of a `.cu` file, after the preprocessor, in source order."""
    proc = subprocess.run([compiler(), "-E", "-x", "c++", "-std=c++20",
                           *_includes(path, header_dirs), str(path)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KernelError(f"{path.name}: preprocessing failed:\n{proc.stderr.strip()}")
    text = proc.stdout
    markers = [(m.start(), int(m.group(1)), m.group(2)) for m in _MARKER.finditer(text)]
    out = []
    for m in _ENTRY.finditer(text):
        i = m.end()
        bounds = None
        b = _BOUNDS.match(text, i)
        if b:
            j = _balanced(text, b.end())
            bounds = _split_args(text[b.end():j - 1])
            i = j
        n = _NAME.match(text, i)
        if not n:
            continue
        # the line: the last marker before the match, plus the newlines since its line
        k = max((x for x in markers if x[0] < m.start()), default=(0, 1, str(path)))
        line = k[1] + text.count("\n", k[0], m.start()) - 1
        out.append(EntryPoint(n.group("name"), Path(k[2]).name, line,
                              bounds[0] if bounds else None,
                              bounds[1] if bounds and len(bounds) > 1 else None))
    return out


def entry_points_of(path: Path, header_dirs=()) -> list[str]:
    """`extern "C" __global__` function names of a `.cu` file, after the preprocessor;
    `header_dirs`: where its `#include "x.cuh"` headers are besides its own directory."""
    return [e.name for e in entry_info(Path(path), header_dirs)]


def rewrite_dynamic_shared(source: str, filename: str) -> str:
    """Rewrite each `extern __shared__ T name[];` into a pointer to the launch's buffer."""
    def sub(m: re.Match) -> str:
        t = " ".join(m.group("type").split())
        return f"{t} *const {m.group('name')} = reinterpret_cast<{t} *>(::emu::dynamic_smem());"
    out = _DYN_SHARED.sub(sub, source)
    left = re.search(r"extern\s+__shared__", out)
    if left:
        line = out.count("\n", 0, left.start()) + 1
        raise KernelError(f"{filename}:{line}: an `extern __shared__` declaration the emulator "
                          "cannot read; write it as `extern __shared__ [__align__(N)] T name[];`")
    return out


def _trailer(module: str, entries: list[EntryPoint]) -> str:
    lines = ["\n// ---- EmuBackend entry points (generated by metrale/gpu_runtime/emu/build.py)"]
    for e in entries:
        n = e.name
        lines += [
            f'extern "C" __attribute__((visibility("default"))) void emu_bounds__{n}(int *b) '
            f"{{ b[0] = static_cast<int>({e.max_threads or 0}); "
            f"b[1] = static_cast<int>({e.min_blocks or 0}); }}",
            f'extern "C" __attribute__((visibility("default"))) const char *emu_sig__{n}() '
            f"{{ return ::emu::signature(&{n}); }}",
            f'extern "C" __attribute__((visibility("default"))) int emu_launch__{n}('
            f"const ::emu::LaunchConfig *c, void **a, char *e, int n) {{ return ::emu::launch("
            f'"{module}.{n}", c, [](void **x) {{ ::emu::invoke(&{n}, x); }}, a, e, n); }}',
        ]
    return "\n".join(lines) + "\n"


def cache_dir() -> Path:
    """Where built libraries live: `<cache_root()>/emu` ($METRALE_CACHE_DIR/emu, else the
    user cache directory)."""
    return cache_root() / "emu"


def _emulator_files() -> list[Path]:
    return sorted([*EMU_DIR.glob("*.h"), *INCLUDE_DIR.glob("*.h")])


def build_library(path: Path, sanitize: bool = False, header_dirs=(),
                  flavour: str | None = None) -> tuple[Path, list[EntryPoint]]:
    """Build (or find in the cache) the library for one `.cu` file; `header_dirs` as for
    `entry_points_of`; `flavour` one of FLAVOURS ("asan" when only `sanitize` is given).

    Returns `(library path, entry points)`. Raises KernelError with the compiler's
    output when the file does not compile.
    """
    flavour = flavour or ("asan" if sanitize else "plain")
    if flavour not in FLAVOURS:
        raise KernelError(f"emu build flavour {flavour!r}: one of {', '.join(FLAVOURS)}")
    path = Path(path).resolve()
    module = path.stem
    entries = entry_info(path, header_dirs)
    source = rewrite_dynamic_shared(path.read_text(), path.name)
    unit = f'#line 1 "{path}"\n{source}\n{_trailer(module, entries)}'
    flags = [*BASE_FLAGS, *ARCH_FLAGS,
             *{"plain": (), "asan": SANITIZE_FLAGS, "check": CHECK_FLAGS}[flavour]]
    h = hashlib.sha256(unit.encode())
    headers = {*path.parent.glob("*.cuh")}
    headers.update(h for d in header_dirs for h in Path(d).glob("*.cuh"))
    for f in [*sorted(headers), *_emulator_files()]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update("\0".join(flags).encode())
    h.update(compiler_version().encode())
    out_dir = cache_dir()
    suffix = "" if flavour == "plain" else f"-{flavour}"
    out = out_dir / f"{module}-{h.hexdigest()[:20]}{suffix}.so"
    if out.is_file():
        return out, entries
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        cpp = Path(tmp) / f"{module}.emu.cpp"
        cpp.write_text(unit)
        lib = Path(tmp) / out.name
        cmd = [compiler(), *flags, *_includes(path, header_dirs), "-include", str(SHIM),
               "-x", "c++", str(cpp)]
        if flavour == "check":
            # compile instrumented, link without libtsan: hooks.h is the runtime
            obj = Path(tmp) / f"{module}.o"
            steps = [[*cmd, "-c", "-o", str(obj)],
                     [compiler(), "-shared", "-Wl,-z,defs", str(obj), "-o", str(lib)]]
        else:
            steps = [[*cmd, "-o", str(lib)]]
        proc = run_build(steps, f"{path.name} for the emulator" + {
            "plain": "", "asan": " with AddressSanitizer",
            "check": " with its checks and counters"}[flavour])
        if proc.returncode != 0:
            raise KernelError(f"{path.name}: the emulator build failed:\n"
                              f"{proc.stderr.strip()[-6000:]}")
        os.replace(lib, out)  # atomic: a concurrent build of the same hash is harmless
    return out, entries
