"""Where the `.cu` sources live and how they are compiled with NVRTC (no GPU needed).

`kernels/` sits at the top of the repository and ships inside the wheel as the package
`metrale.kernels`, so a checkout and a plain `pip install .` both find it.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor, as_completed
import re
from functools import lru_cache
from pathlib import Path

from ..errors import DeviceError, KernelError

ARCHS = ("sm_80", "sm_90")
# Options shared by CuPy's RawModule (CudaBackend) and the GPU-free check: the kernels are
# written for FP32 accumulation with explicit BF16 rounding, so fast-math only relaxes
# expf/rsqrtf precision, which the tolerance table covers.
NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")


def kernels_dir() -> Path:
    """The directory holding `*.cu` files: the installed package data, else the checkout."""
    try:
        import metrale.kernels as pkg  # present in an installed wheel
        for p in getattr(pkg, "__path__", []):
            if any(Path(p).glob("*.cu")):
                return Path(p)
    except ImportError:
        pass
    here = Path(__file__).resolve().parents[2] / "kernels"
    if here.is_dir():
        return here
    raise DeviceError("kernels directory not found: neither metrale/kernels (installed) "
                      f"nor {here} (checkout) exists")


def kernel_files() -> list[Path]:
    return sorted(kernels_dir().glob("*.cu"))


def module_path(module: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_]+", module):
        raise KernelError(f"bad kernel module name {module!r}")
    p = kernels_dir() / f"{module}.cu"
    if not p.is_file():
        raise KernelError(f"kernel module {module!r}: {p} does not exist")
    return p


def has_module(module: str) -> bool:
    """Whether `kernels/<module>.cu` exists."""
    try:
        module_path(module)
        return True
    except KernelError:
        return False


def read_source(module) -> tuple[str, str]:
    """`(source, hash)` of a module (or of a `.cu` file given as a Path); the hash covers
    every header in kernels/ too.

    CuPy's kernel cache key misses headers pulled in through `-I` (CUPY_NOTES §5), so the
    hash goes into the compile options as `-DMETRALE_SRC_HASH=...`.
    """
    src = (module if isinstance(module, Path) else module_path(module)).read_text()
    h = hashlib.sha256(src.encode())
    for hdr in sorted(kernels_dir().glob("*.cuh")):
        h.update(hdr.read_bytes())
    return src, h.hexdigest()[:16]


def entry_points(module: str) -> list[str]:
    """The `extern "C" __global__` kernels of `kernels/<module>.cu`, read from the
    preprocessed source (so kernels a macro generates count), in source order."""
    from .emu.build import entry_points_of
    return entry_points_of(module_path(module), [kernels_dir()])


_ASM = re.compile(r"\basm\s*(?:volatile\s*|__volatile__\s*)?\(")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def unguarded_asm(text: str) -> list[str]:
    """Problems with inline asm: each `asm(` must sit in the `#ifdef __CUDA_ARCH__` branch of a
    conditional that has an `#else` (the C++ the EmuBackend compiles). One line per problem."""
    text = _COMMENTS.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    problems: list[str] = []
    stack: list[dict] = []  # per open #if: is the current branch device-only, asm seen, #else
    for no, line in enumerate(text.splitlines(), 1):
        st = line.strip()
        if st.startswith("#"):
            d = st[1:].strip()
            word = d.split("(")[0].split()[0] if d else ""
            if word in ("if", "ifdef", "ifndef"):
                positive = "__CUDA_ARCH__" in d and word != "ifndef" and "!" not in d
                stack.append({"device": positive, "line": no, "asm": False, "else": False})
            elif word in ("else", "elif") and stack:
                stack[-1]["device"] = False
                stack[-1]["else"] = True
            elif word == "endif" and stack:
                top = stack.pop()
                if top["asm"] and not top["else"]:
                    problems.append(f"line {top['line']}: the #if around inline asm has no "
                                    "#else with a C++ fallback")
            continue
        if _ASM.search(line):
            guard = next((e for e in reversed(stack) if e["device"]), None)
            if guard is None:
                problems.append(f"line {no}: inline asm outside an #ifdef __CUDA_ARCH__ branch")
            else:
                guard["asm"] = True
    return problems


@lru_cache(maxsize=1)
def cuda_include_dir() -> str | None:
    """The directory with cuda_bf16.h / cuda_fp16.h (nvidia-cuda-runtime-cu12 or a CTK)."""
    try:
        import cuda.pathfinder as pf
        d = pf.find_nvidia_header_directory("cudart")
        if d:
            return str(d)
    except Exception:  # pathfinder missing or too old: fall back to a system CTK
        pass
    for cand in ("/usr/local/cuda/include",):
        if Path(cand, "cuda_bf16.h").is_file():
            return cand
    return None


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> list[dict]:
    """Per-kernel registers / spills / static shared memory from a `-v` ptxas log."""
    out: list[dict] = []
    cur: dict | None = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            cur = {"name": m.group(1), "registers": 0, "spill_stores": 0, "spill_loads": 0,
                   "shared_bytes": 0}
            out.append(cur)
            continue
        if cur is None:
            continue
        if (m := _PTXAS_SPILL.search(line)):
            cur["spill_stores"], cur["spill_loads"] = int(m.group(1)), int(m.group(2))
        if (m := _PTXAS_REGS.search(line)):
            cur["registers"] = int(m.group(1))
            if (s := _PTXAS_SMEM.search(line)):
                cur["shared_bytes"] = int(s.group(1))
    return out


def compile_cubin(module, arch: str) -> tuple[bytes, str]:
    """Compile `kernels/<module>.cu` (or a `.cu` Path that includes kernels/ headers) for
    `arch` with NVRTC; returns `(cubin, log)`.

    Raises KernelError with the compiler log on failure. Needs no GPU.
    """
    from cuda.bindings import nvrtc

    src, src_hash = read_source(module)
    name = module.name if isinstance(module, Path) else f"{module}.cu"
    opts = [f"--gpu-architecture={arch}", *NVRTC_OPTIONS, "--ptxas-options=-v",
            f"-I{kernels_dir()}", f"-DMETRALE_SRC_HASH={src_hash}"]
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")

    def check(res, what):
        err = res[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelError(f"{name}: NVRTC {what} failed: {err}")
        return res[1] if len(res) > 1 else None

    prog = check(nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []),
                 "create")
    try:
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        n = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * n
        check(nvrtc.nvrtcGetProgramLog(prog, log), "log")
        log_s = log.rstrip(b"\0 ").decode(errors="replace")
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelError(f"{name} failed to compile for {arch}:\n{log_s}")
        n = check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * n
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin, log_s
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def check_all(archs=ARCHS, on_record=None, workers: int | None = None) -> list[dict]:
    """Compile every kernel file for every arch; one record per (file, arch), in file then
    arch order. `on_record(record, index, total)` is called as each record is made
    (progress, in completion order). `workers`: compiles at once (NVRTC releases the GIL;
    None: one per usable CPU).

    A record fails when the file does not compile, when an entry point of the preprocessed
    source is missing from what ptxas compiled, or when inline asm has no C++ fallback.
    """
    from .native import usable_cpus

    jobs = []
    for path in kernel_files():
        lint = unguarded_asm(path.read_text())
        try:
            names, names_error = entry_points(path.stem), None
        except Exception as e:  # no C++ preprocessor, or it failed
            names, names_error = [], str(e)
        jobs += [(path, arch, lint, names, names_error) for arch in archs]

    def one(job) -> dict:
        path, arch, lint, names, names_error = job
        rec = {"file": path.name, "arch": arch, "ok": False, "entry_points": names,
               "kernels": [], "error": None}
        try:
            _, log = compile_cubin(path.stem, arch)
            rec["kernels"] = parse_ptxas(log)
            compiled = {k["name"] for k in rec["kernels"]}
            errors = [f"{path.name}: {p}" for p in lint]
            if names_error:
                errors.append(f"{path.name}: entry points unknown: {names_error}")
            missing = [n for n in names if n not in compiled]
            if missing:
                errors.append(f"{path.name}: entry points not compiled: {missing}")
            rec["error"] = "\n".join(errors) or None
            rec["ok"] = not errors
        except Exception as e:  # report every file, then fail at the end
            rec["error"] = str(e)
        return rec

    records: list[dict | None] = [None] * len(jobs)
    with ThreadPoolExecutor(max(1, workers or usable_cpus())) as pool:
        futures = {pool.submit(one, job): i for i, job in enumerate(jobs)}
        for done, fut in enumerate(as_completed(futures), 1):
            records[futures[fut]] = fut.result()
            if on_record is not None:
                on_record(records[futures[fut]], done, len(jobs))
    return records
