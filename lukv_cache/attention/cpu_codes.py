"""The CPU decode step over a quantized store's codes: one C kernel, built on first use with the system's C
compiler, that reads 8- or 4-bit rows and never writes a dequantized block.

Without it a quantized store on CPU is read in blocks (:mod:`.compressed`): each decode step dequantizes
every stored row to the model's dtype, then attends, so 8 and 4 bits decoded slower than the fp32 store they
replace. The kernel (``cpu_codes.c``, beside this file) streams each segment's rows once, dequantizes a
block of 16 rows into a stack buffer, and keeps the online softmax (running max, sum and weighted value sums,
fp32) per query row; the segment's rows are cut into work items of :data:`CHUNK` rows spread over
``torch.get_num_threads()`` OpenMP threads, the rows appended in place beside the store (its tail, when there is
one) and the dense suffix are more items, and the items merge by
log-sum-exp (flash-decoding). Where the compiler targets AVX-512 or AVX2 with FMA (``-march=native`` on such
a CPU) the common head sizes (64, 128, 256) take a vectorised block (16-float vectors on AVX-512, 8-float ones on
AVX2: :func:`vector_lanes`): a block's 16 logits come out of trees of shuffles, its softmax runs on the lanes,
the value sums of a tile of query rows stay in registers (at head_dim 64 about 1.7x the scalar loop's speed on
AVX-512 and 1.4-1.7x on AVX2; 1.1-1.6x on AVX2 at 128 and 256, where a row's sums outgrow its 16 registers:
``benchmarks/cpu_kernel_builds.py``). Exact up to fp32 rounding against dequantize-then-attend, each build
(``tests/attention/test_cpu_codes.py``).

The kernel is compiled once per machine into ``<cache_root()>/kernels`` (``$LUKV_CACHE_DIR``, else
``~/.cache/lukv_cache``): ``$CC``, else ``cc``, ``gcc`` or ``clang``, with ``-O3 -march=native -fopenmp``
(without OpenMP, then without ``-march=native``, when the compiler refuses them); the library's name carries a
hash of the source, the flags, the compiler and the CPU, and is written by rename (never half a file). When no
compiler builds it, :func:`kernel` is ``None``, one warning says so, and the blocks serve (slower, same
results). ``LUKV_CPU_KERNEL=0`` turns it off; ``LUKV_CPU_KERNEL_FLAGS`` replaces the flags (one set, no
fallback: e.g. ``-O3 -march=haswell -fopenmp -fno-math-errno``, the code an AVX2 CPU builds, to time it on a
newer one; a target this CPU lacks, e.g. a newer ``-march``, builds but stops the process at the first decode
step with an illegal instruction).

It serves (:func:`serves`): a CPU query, an 8- or 4-bit store with bf16 scales (fp32 and bf16 models; an fp16
model's fp16 scales take the blocks), a head_dim of at most 256, at most 64 query rows per KV head, and a
mask that hides nothing (decode); softcaps and sinks included (the log-sum-exp comes back).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from .._paths import cache_root
from .calls import StoreView, TailView

logger = logging.getLogger("lukv_cache")

SOURCE = Path(__file__).with_name("cpu_codes.c")
CHUNK = 256  # rows per work item: a few items per segment at 4k, enough to spread over the threads
MAX_DIM = 256  # the kernel's buffers (MAX_D, MAX_M in cpu_codes.c)
MAX_ROWS = 64
ENV = "LUKV_CPU_KERNEL"
FLAGS_ENV = "LUKV_CPU_KERNEL_FLAGS"
_FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp", "-fno-math-errno"),
    ("-O3", "-march=native", "-fno-math-errno"),
    ("-O3", "-fno-math-errno"),
)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None once tried


def compilers() -> list[str]:
    """The C compilers to try, in order: ``$CC``, then those of ``cc``, ``gcc``, ``clang`` on the PATH."""
    named = os.environ.get("CC")
    found = [named] if named else []
    found += [c for c in ("cc", "gcc", "clang") if shutil.which(c)]
    return list(dict.fromkeys(found))


def _cpu_line() -> str:
    """The CPU's flags line of ``/proc/cpuinfo`` (``Features`` on ARM), or ``""`` (another OS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cpu_tag() -> str:
    """What ``-march=native`` depends on: the machine and, on Linux, the CPU's flags."""
    return platform.machine() + _cpu_line()


def cpu_flags() -> set[str]:
    """The instruction-set flags Linux reports for this CPU (``avx2``, ``fma``, ``avx512f``, ...; empty
    elsewhere): which of :func:`load`'s targets this machine can run.

    >>> {"avx2", "fma"} <= cpu_codes.cpu_flags()  # doctest: +SKIP
    True
    """
    return set(_cpu_line().partition(":")[2].split())


def _build(directory: Path, flag_sets: tuple[tuple[str, ...], ...] = _FLAG_SETS) -> Path | None:
    """The library for this source, compiler and CPU in ``directory``, compiled with the first of ``flag_sets``
    the compiler accepts if it is not there yet."""
    source = SOURCE.read_bytes()
    for compiler in compilers():
        for flags in flag_sets:
            key = hashlib.sha256(
                b"\0".join([source, " ".join(flags).encode(), compiler.encode(), _cpu_tag().encode()])
            ).hexdigest()[:16]
            target = directory / f"lukv_cpu_codes_{key}.so"
            if target.exists():
                return target
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as work:
                built = Path(work) / target.name
                command = [compiler, *flags, "-shared", "-fPIC", "-o", str(built), str(SOURCE), "-lm"]
                try:
                    done = subprocess.run(command, capture_output=True, timeout=300, check=False)
                except (OSError, subprocess.SubprocessError):
                    break  # this compiler does not run: the next one
                if done.returncode == 0 and built.exists():
                    os.replace(built, target)  # whole or not at all
                    return target
    return None


def _load(flag_sets: tuple[tuple[str, ...], ...] = _FLAG_SETS) -> ctypes.CDLL | None:
    try:
        path = _build(cache_root() / "kernels", flag_sets)
    except OSError:  # the cache is not writable: build in a temporary folder for this process
        path = _build(Path(tempfile.mkdtemp(prefix="lukv_kernels_")), flag_sets)
    if path is None:
        named = "" if flag_sets == _FLAG_SETS else f" with the flags {' '.join(flag_sets[0])!r}"
        logger.warning(
            "lukv_cache: no C compiler built the CPU kernel for quantized caches%s (tried %s): kv_bits and "
            "memory= decode by dequantizing blocks, slower than the fp32 store. Install gcc or clang, or set "
            "CC%s.",
            named,
            ", ".join(compilers()) or "cc, gcc, clang: none found",
            f", or unset {FLAGS_ENV}" if named else "",
        )
        return None
    lib: ctypes.CDLL | None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:  # not a library this process can load (damaged, another machine's): rebuilt once
        path.unlink(missing_ok=True)
        rebuilt = _build(path.parent, flag_sets)
        try:
            lib = ctypes.CDLL(str(rebuilt)) if rebuilt is not None else None
        except OSError:
            lib = None
        if lib is None:
            logger.warning(
                "lukv_cache: the CPU kernel for quantized caches does not load (%s): kv_bits and memory= "
                "decode by dequantizing blocks.",
                error,
            )
            return None
    return _bind(lib)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with its functions' signatures declared (ctypes passes nothing right without them)."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    decode = lib.lukv_codes_decode
    decode.argtypes = (
        [i32] * 5
        + [ctypes.c_float]
        + [ptr] * 8
        + [i32, i32]
        + [ptr] * 6
        + [i32, ctypes.c_int64, ptr, ptr, ctypes.c_float, i32, i32, ptr, ptr]
    )
    decode.restype = i32
    lib.lukv_codes_lanes.argtypes = []
    lib.lukv_codes_lanes.restype = i32
    return lib


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call; ``None`` when it cannot be (or is turned off).
    ``$LUKV_CPU_KERNEL_FLAGS`` (compiler flags, split at spaces) builds it with those instead of the defaults."""
    if os.environ.get(ENV, "1") == "0":
        return None
    named = os.environ.get(FLAGS_ENV)
    if named and named.split():
        return load(tuple(named.split()))
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def load(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel compiled with these compiler ``flags`` instead of the defaults (e.g. ``("-O3",
    "-march=haswell", "-fopenmp", "-fno-math-errno")``: the code an AVX2 CPU gets, run on a newer one), built
    once per process like :func:`kernel` and cached beside it; ``None`` when no compiler builds it. For tests and
    benchmarks: pass it to :func:`codes_attention` as ``lib``.

    >>> cpu_codes.vector_lanes(cpu_codes.load(("-O3", "-march=haswell", "-fno-math-errno")))  # doctest: +SKIP
    8
    """
    key = "flags " + " ".join(flags)
    if key not in _state:
        with _lock:
            if key not in _state:
                _state[key] = _load((tuple(flags),))
    return _state[key]  # type: ignore[return-value]


# The kernel as other x86-64 CPUs build it, to test and time their code on a newer one: name -> (compiler flags,
# the CPU flags that code needs). "avx2 scalar" is the scalar loop an AVX2 CPU ran before its vectors.
TARGETS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx2": (("-O3", "-march=haswell", "-fopenmp", "-fno-math-errno"), frozenset({"avx2", "fma"})),
    "avx2 scalar": (
        ("-O3", "-march=haswell", "-DLUKV_SCALAR", "-fopenmp", "-fno-math-errno"),
        frozenset({"avx2", "fma"}),
    ),
    "x86-64": (("-O3", "-march=x86-64", "-fopenmp", "-fno-math-errno"), frozenset()),
}


def load_target(name: str) -> ctypes.CDLL | None:
    """:func:`load` of ``TARGETS[name]``'s flags; ``None`` where this CPU cannot run that code (not x86-64,
    or without the flags it needs) or no compiler builds it.

    >>> cpu_codes.vector_lanes(cpu_codes.load_target("avx2"))  # doctest: +SKIP
    8
    """
    flags, needs = TARGETS[name]
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        return None
    return load(flags)


def vector_lanes(lib: ctypes.CDLL | None = None) -> int:
    """The floats per vector ``lib`` (default: :func:`kernel`) runs the common head sizes (64, 128, 256) at: 16
    where the compiler targeted AVX-512, 8 for AVX2 with FMA, 0 where the scalar loop serves them (other CPUs,
    older compilers) or when there is no kernel.

    >>> cpu_codes.vector_lanes()  # doctest: +SKIP
    16
    """
    lib = kernel() if lib is None else lib
    return 0 if lib is None else int(lib.lukv_codes_lanes())


@contextlib.contextmanager
def turned_off() -> Iterator[None]:
    """The kernel turned off for a while (``LUKV_CPU_KERNEL=0``, what :func:`kernel` reads at every call): a
    quantized store is read in dequantized blocks meanwhile (benchmarks and tests of that path).

    >>> with cpu_codes.turned_off():  # doctest: +SKIP
    ...     cpu_codes.kernel() is None
    True
    """
    before = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def reset() -> None:
    """Forget the loaded library: the next :func:`kernel` looks for it (or builds it) again, e.g. after
    ``CC`` or ``LUKV_CACHE_DIR`` changed."""
    with _lock:
        _state.clear()


def serves(query: torch.Tensor, store: StoreView) -> bool:
    """Whether :func:`codes_attention` takes grouped ``query [B, H_kv, M, D]`` over ``store`` (the
    caller has checked that the mask hides nothing)."""
    keys = store.keys
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and getattr(store, "kv_bits", None) in (8, 4)
        and getattr(keys, "scale", None) is not None
        and keys.scale.dtype == torch.bfloat16  # type: ignore[attr-defined]
        and query.shape[-1] <= MAX_DIM
        and query.shape[-2] <= MAX_ROWS
        and kernel() is not None
    )


def _segment_rows(t: torch.Tensor, copy: bool = False) -> tuple[torch.Tensor, int]:
    """A dense suffix ``[B, H, S, D]`` as the kernel reads it: fp32 rows of ``D`` floats, segment ``b * H + h``'s
    ``S`` of them at ``(b * H + h) * stride``; the suffix's own buffers as they are (no copy) when they are laid
    out so (fp32, ``[B, H, capacity, D]``) and ``copy`` is not asked, else a contiguous copy."""
    b, h, length, d = t.shape
    st = t.stride()
    laid_out = st[3] == 1 and (length <= 1 or st[2] == d) and st[0] == h * st[1]
    if not copy and t.dtype == torch.float32 and laid_out:
        return t, st[1]
    return t.reshape(b * h, length, d).float().contiguous(), length * d


def codes_attention(
    query: torch.Tensor,
    store: StoreView,
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    lib: ctypes.CDLL | None = None,
    tail: TailView | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``out [B, H_kv, M, D]`` and ``lse [B, H_kv, M]``: grouped ``query [B, H_kv, M, D]`` over each
    segment of the quantized ``store``, its rows of ``tail`` (the rows decoding appended since the store was
    built, a :class:`~.calls.TailView`, in the store's bits) and of the dense suffix
    ``[B, H_kv, S, D]`` (everything attended: no mask), the logits soft-capped if asked. A segment with nothing
    to attend gives ``out = 0``, ``lse = -inf``. Only where :func:`serves` says so. ``lib``: the kernel to run
    (default :func:`kernel`; another build from :func:`load`).
    """
    lib = kernel() if lib is None else lib
    assert lib is not None  # serves() checked
    b, h, m, d = query.shape
    segments = b * h
    keys, values = store.keys, store.values
    q = query.reshape(segments, m, d).float().contiguous()  # a view of a decode step's query
    length = suffix_keys.shape[-2]
    sk, stride = _segment_rows(suffix_keys)
    sv, value_stride = _segment_rows(suffix_values)
    if value_stride != stride:  # one stride for both: contiguous copies
        (sk, stride), (sv, _) = _segment_rows(suffix_keys, copy=True), _segment_rows(suffix_values, copy=True)
    out = torch.empty(segments, m, d)
    lse = torch.empty(segments, m)
    offsets = store.offsets if store.offsets.dtype == torch.int64 else store.offsets.long()
    # the kernel reads every tensor as a dense row-major array (a no-op for the store's own tensors)
    parts = [
        t.contiguous()
        for t in (keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero)  # type: ignore[attr-defined]
    ]
    tail_len = 0 if tail is None else tail.length
    if tail is None or not tail_len:  # no tail: its pointers are never read
        tail_cap, tail_parts = 0, [0] * 6
    else:
        tail_cap = tail.capacity
        if tail.keys.scale.dtype != keys.scale.dtype or tail.keys.bits != keys.bits:  # type: ignore[attr-defined]
            raise RuntimeError("lukv_cache's CPU kernel: a store's tail is not in the store's format")
        tail_parts = [t.data_ptr() for rows in (tail.keys, tail.values) for t in rows.tensors()]
    status = lib.lukv_codes_decode(
        segments,
        m,
        d,
        store.kv_bits,  # type: ignore[attr-defined]
        d // keys.scale.shape[-1],  # type: ignore[attr-defined]
        float(scaling),
        q.data_ptr(),
        *(t.data_ptr() for t in parts),
        offsets.contiguous().data_ptr(),
        tail_len,
        tail_cap,
        *tail_parts,
        length,
        stride,
        sk.data_ptr(),
        sv.data_ptr(),
        0.0 if softcap is None else float(softcap),
        CHUNK,
        torch.get_num_threads(),
        out.data_ptr(),
        lse.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(
            f"lukv_cache's CPU kernel refused a call (status {status}): head_dim {d}, rows {m}"
        )
    return out.view(b, h, m, d), lse.view(b, h, m)
