"""pagedlib's fused paged attention for CPUs (notebooks 04 and 05; ``attention="cpu"`` in the engine):
``paged_attention_varlen_cpu`` takes ``paged_attention_varlen``'s arguments and returns its result, computed
by a C kernel (``cpu_varlen.c``, beside this file) that walks the block tables itself, reading each block
where it lies, as the Triton kernels do on a GPU and vLLM's ``cpu_attention_with_kv_cache`` does on a CPU.

The kernel is built on first use with the machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``), for the machine's own vector instructions and with OpenMP where the compiler has it, in about a
second, and kept in a cache folder (``$PAGEDLIB_CACHE_DIR``, else ``~/.cache/pagedlib``) under a name that
hashes the source, the compiler, the flags and the processor: a changed one builds anew. It is loaded with
``ctypes`` (no Python or torch headers are needed) and runs on ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from pagedlib.core.fp8 import FP8_DTYPES
from pagedlib.kernels._checks import MAX_CPU_BLOCK_SIZE as MAX_CPU_BLOCK_SIZE  # re-exported: checks.py
from pagedlib.kernels._checks import MAX_HEAD_DIM as MAX_HEAD_DIM  # reads them
from pagedlib.kernels._checks import check_cpu_inputs, check_scales, check_varlen_inputs, check_window_size
from pagedlib.kernels.attention import softmax_scale

SOURCE = Path(__file__).with_name("cpu_varlen.c")
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # cpu_varlen.c's F32, F16, BF16; fp8: 3
# tried in order until one builds: the machine's own instructions (x86/Linux, then Arm's spelling), none;
# OpenMP threads, else OpenMP's vector loops alone (one thread), else neither
ARCH_FLAGS = (["-march=native"], ["-mcpu=native"], [])
THREAD_FLAGS = (["-fopenmp"], ["-fopenmp-simd"], [])


class Pool(ctypes.Structure):
    """``cpu_varlen.c``'s ``Pool``: one of K or V, where its elements are and how to read them."""

    _fields_ = [("data", ctypes.c_void_p), ("block", ctypes.c_int64), ("slot", ctypes.c_int64),
                ("head", ctypes.c_int64), ("kind", ctypes.c_int), ("table", ctypes.c_void_p),
                ("scale", ctypes.c_void_p)]


_lock = threading.Lock()
_kernel: dict[str, object] = {}  # "function": the loaded entry point, "info": how it was built


def paged_attention_varlen_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               query_start_loc: torch.Tensor, scale: float | None = None, *,
                               k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                               window: int | None = None) -> torch.Tensor:
    """``paged_attention_varlen`` (same arguments, same result) by the fused C kernel, on a CPU.

    Args:
        q: ``[T, q_heads, head_dim]``, the new tokens of every sequence, one sequence after the other.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` (strided views too; fp8 allowed).
        block_tables, seq_lens, query_start_loc: int32 ``[batch, max_blocks]``, ``[batch]``, ``[batch + 1]``.
        scale: softmax scale; default ``head_dim ** -0.5``.
        k_scale, v_scale: an fp8 cache's scales, a float or ``[kv_heads]``.
        window: a sliding window, an int >= 1 (``paged_attention_varlen``'s); ``None``: causal.
    Returns:
        ``[T, q_heads, head_dim]``, like ``q``. ``RuntimeError`` if no C compiler can build the kernel.
    """
    window = check_window_size(window)
    check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, window)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    check_cpu_inputs(q, k_cache, v_cache)
    scale = softmax_scale(q.shape[2], scale)
    return attend_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale,
                      window=window)


def attend_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
               k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, *,
               window: int | None = None) -> torch.Tensor:
    """``paged_attention_varlen_cpu`` on checked inputs (``check_scales``' scales, ``window`` an int >= 1 or
    ``None``): the engine's path. The kernel reads float32 queries and writes float32 rows; other dtypes are
    converted on the way. It starts each walk at the first block a window reaches: ``NULL_BLOCK`` entries
    before it are never read."""
    kernel = load_kernel()
    x = q.to(torch.float32).contiguous()                                      # [T, q_heads, head_dim]
    out = torch.empty_like(x)
    tables = block_tables.contiguous()
    lens, starts = seq_lens.contiguous(), query_start_loc.contiguous()
    pools = [_pool(cache, s) for cache, s in ((k_cache, k_scale), (v_cache, v_scale))]
    status = kernel(x.data_ptr(), out.data_ptr(), ctypes.byref(pools[0][0]), ctypes.byref(pools[1][0]),
                    tables.data_ptr(), tables.stride(0), lens.data_ptr(), starts.data_ptr(), lens.shape[0],
                    q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], k_cache.shape[0], scale,
                    torch.get_num_threads(), window or 0)
    if status == -1:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    if status:
        raise ValueError(f"block_tables names a block outside the pool of {k_cache.shape[0]} blocks")
    return out.to(q.dtype)


def _pool(cache: torch.Tensor, scale: float | torch.Tensor) -> tuple[Pool, list[torch.Tensor]]:
    """A ``Pool`` for ``cache`` and the tensors it points into (kept alive by the caller until the call
    returns): fp8 bytes read through a table of their 256 values, times the per-head scales."""
    heads = cache.shape[2]
    if isinstance(scale, torch.Tensor):
        scales = scale.to(torch.float32).expand(heads).contiguous()           # [kv_heads]
    else:
        scales = _constant(float(scale), heads)
    kind, data, table = KINDS.get(cache.dtype, 3), cache, None
    if cache.dtype in FP8_DTYPES:
        data, table = cache.view(torch.uint8), _byte_values(cache.dtype)
    stride = data.stride()
    pool = Pool(data.data_ptr(), stride[0], stride[1], stride[2], kind,
                None if table is None else table.data_ptr(), scales.data_ptr())
    return pool, [scales]


@functools.lru_cache(maxsize=64)
def _constant(value: float, heads: int) -> torch.Tensor:
    """float32 ``[heads]`` of ``value`` (a scale given as a number), made once (never written)."""
    return torch.full((heads,), value, dtype=torch.float32)


@functools.cache
def _byte_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[256]``: the value each byte of an fp8 ``dtype`` stands for (NaN codes included)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def load_kernel():
    """The kernel's entry point, built (or found in the cache folder) and loaded on first use."""
    with _lock:
        if "error" in _kernel:       # tried and failed in this process: said once, not compiled again
            raise RuntimeError(_kernel["error"])
        if "function" not in _kernel:
            try:
                lib = _load()
            except RuntimeError as error:
                _kernel["error"] = str(error)
                raise
            fn = lib.paged_attention_varlen_cpu
            i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
            fn.argtypes = [ptr, ptr, ctypes.POINTER(Pool), ctypes.POINTER(Pool), ptr, i64, ptr, ptr,
                           i32, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]
            fn.restype = ctypes.c_int
            _kernel["function"] = fn
        return _kernel["function"]


def _load() -> ctypes.CDLL:
    """The built library, loaded; a damaged file in the cache folder is built again, once."""
    path = build()
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)
    try:
        return ctypes.CDLL(str(build()))
    except OSError as error:
        raise RuntimeError(f"attention='cpu' built its C kernel but cannot load it: {error}") from None


def kernel_info() -> dict[str, object]:
    """How the loaded kernel was built: compiler, flags (``-fopenmp`` among them: it runs threads) and the
    library's path. Builds it if needed."""
    load_kernel()
    return dict(_kernel["info"])


def cpu_kernel_available() -> tuple[bool, str]:
    """``(True, "")`` if the kernel builds and loads here, else ``(False, why)``."""
    try:
        load_kernel()
    except RuntimeError as error:
        return False, str(error)
    return True, ""


def build() -> Path:
    """The compiled kernel's path: from the cache folder if it holds this build, else compiled there now
    (written under a temporary name and renamed, so a reader never sees half a library)."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    folder = _cache_folder()
    errors = []
    for arch in ARCH_FLAGS:
        for threads in THREAD_FLAGS:
            flags = ["-O3", "-shared", "-fPIC", *arch, *threads]
            key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, version, " ".join(flags),
                                            _processor()]).encode()).hexdigest()[:16]
            target = folder / f"cpu_varlen-{key}.so"
            if not target.exists():
                error = _compile(compiler, flags, target)
                if error:
                    errors.append(f"{' '.join(flags)}: {error}")
                    continue
            _kernel["info"] = {"compiler": compiler, "flags": flags, "path": str(target)}
            return target
    raise RuntimeError(f"attention='cpu' could not build its C kernel with {compiler}:\n" + "\n".join(errors))


def _compile(compiler: str, flags: list[str], target: Path) -> str:
    """Compile ``SOURCE`` to ``target``; the compiler's complaint, or "" once it is in place."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        command = [compiler, *flags, str(SOURCE), "-o", tmp, "-lm"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            return (done.stderr.strip().splitlines() or ["failed"])[-1]
        os.replace(tmp, target)
        return ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compiler() -> str:
    """``$CC`` if set, else the first of cc, gcc, clang on the PATH; ``RuntimeError`` if there is none."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(f"attention='cpu' builds a C kernel and needs a C compiler: none of {names} is on the "
                       "PATH (Debian/Ubuntu: apt install gcc; macOS: xcode-select --install); "
                       "attention='torch' needs none")


def _cache_folder() -> Path:
    """``$PAGEDLIB_CACHE_DIR``, else ``~/.cache/pagedlib`` (made if missing), else a temporary folder."""
    folder = Path(os.environ.get("PAGEDLIB_CACHE_DIR") or Path.home() / ".cache" / "pagedlib")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="pagedlib-"))


def _processor() -> str:
    """What ``-march=native`` compiles for: the CPU's model name and feature flags where Linux says them."""
    text = platform.machine() + platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return text
    return text + "".join(line for line in lines[:40] if line.startswith(("model name", "flags", "Features")))
