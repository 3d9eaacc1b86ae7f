"""Compile Triton kernel variants ahead of time for a CUDA architecture, on a machine without a GPU (Triton ships
its own ptxas), as the JIT would compile them at their launches, so that GPU-only compile errors surface in
CPU-only CI and the code the GPU runs can be read here.

A variant is what Triton's JIT specializes a launch on: the constexprs, the options (warps, stages) and each
other argument's class, read from the launch's own values by Triton's own rule (`native_specialize_impl`):
a tensor's dtype and whether its address is 16-byte aligned, an integer's width and whether it is divisible
by 16, an integer equal to 1 compiled as the constant 1. The divisibility decides how wide the loads are, and
with it whether a loop's loads are software-pipelined through shared memory (`cp.async`): compiled without it,
the paged attention's key loop issued one dependent gather after another, 7 KB of shared memory, where the
JIT's variant pipelines them, 11 KB (docs/benchmarks.md). So variants are not listed here by hand: `record`
catches the launches of real calls (on the meta device their kernels never run; a tensor's offset still
counts) and `compile_variants` compiles each distinct one. `workers/kernel_variants.py` drives the engine's
model through the steps it launches, at the shapes it serves."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# the most shared memory one block may take (bytes; CUDA's opt-in maximum): a kernel compiled past it raises
# OutOfResources at its first launch, which compiling alone does not show
SHARED_MEMORY_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class Variant:
    """One compilation of a kernel: its name, the JIT's signature (argument name -> type, or "constexpr"),
    constexprs by argument index, divisibility attributes by argument index, and options."""

    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[int, Any], ...]
    attrs: tuple[tuple[int, int], ...]  # (argument index, divisibility)
    options: tuple[tuple[str, Any], ...]

    def label(self) -> str:
        names = [n for n, _ in self.signature]
        consts = ", ".join(f"{names[i]}={v}" for i, v in self.constexprs)
        aligned = {i for i, _ in self.attrs}
        ints = [n for i, (n, t) in enumerate(self.signature) if t[0] in "iu" and t != "u1" and i in aligned]
        unaligned = [n for i, (n, t) in enumerate(self.signature) if t.startswith("*") and i not in aligned]
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        return (f"{self.name}({consts}; divisible by 16: {', '.join(ints) or '-'}"
                f"{'; unaligned: ' + ', '.join(unaligned) if unaligned else ''}; {opts})")


def specialize(kernel, args: tuple, kwargs: dict) -> Variant:
    """The variant Triton's JIT compiles for `kernel[grid](*args, **kwargs)`."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = kernel.params
    names = [p.name for p in params]
    bound = inspect.signature(kernel.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    signature, constexprs, attrs = [], [], []
    for i, p in enumerate(params):
        value = bound.arguments[p.name]
        if p.is_constexpr:
            signature.append((p.name, "constexpr"))
            constexprs.append((i, value))
            continue
        kind, key = native_specialize_impl(BaseBackend, value, p.is_const, not p.do_not_specialize,
                                           not p.do_not_specialize_on_alignment)
        signature.append((p.name, kind))
        if kind == "constexpr":  # an integer 1
            constexprs.append((i, key))
        elif isinstance(key, str) and "D" in key:
            attrs.append((i, 16))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return Variant(kernel.fn.__name__, tuple(signature), tuple(constexprs), tuple(attrs), options)


def normalized(variant: Variant) -> Variant:
    """`variant` with only its warps and pipeline stages for options, Triton's defaults (4, 3) where its launch
    gave none: the form `compiled_variant` reads from a compiled kernel."""
    options = dict(variant.options)
    return dataclasses.replace(variant, options=(("num_stages", options.get("num_stages", 3)),
                                                 ("num_warps", options.get("num_warps", 4))))


def compiled_variant(src, metadata: dict) -> Variant:
    """The (normalized) variant a compilation was of, from what Triton's compilation listener
    (`knobs.compilation.listener`) is given: the `ASTSource` and the compiled kernel's metadata."""
    attrs = tuple(sorted((k[0], d) for k, specs in src.attrs.items() for name, d in specs if name == "tt.divisibility"))
    constexprs = tuple(sorted((k[0], v) for k, v in src.constants.items()))
    return Variant(src.fn.__name__, tuple(src.signature.items()), constexprs, attrs,
                   (("num_stages", metadata["num_stages"]), ("num_warps", metadata["num_warps"])))


@contextlib.contextmanager
def record() -> Iterator[dict[Variant, Any]]:
    """Within it, every Triton kernel launch is recorded (variant -> kernel, in first-launch order) and not run."""
    from triton.runtime.jit import JITFunction

    seen: dict[Variant, Any] = {}
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        seen.setdefault(specialize(self, args, kwargs), self)

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = original


def jit_source(kernel, variant: Variant, arch: int) -> tuple[Any, Any, Any]:
    """(source, options, target) of `variant` as the JIT's launch builds them: the specialization the JIT's binder
    gives (each argument's type and "D" or "", a constexpr's value) through the JIT's own `_pack_args`, and the
    options with the debug and instrumentation settings a launch adds. Compiled from these, a kernel lands in
    Triton's cache under the key the JIT looks up on a GPU of that `arch` with the same Triton."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    constexprs, aligned = dict(variant.constexprs), {i for i, _ in variant.attrs}
    specialization, bound = [], {}
    for i, (name, kind) in enumerate(variant.signature):
        if kind == "constexpr":
            specialization.append(("constexpr", constexprs[i]))
            bound[name] = constexprs[i]
        else:
            # floats and bools are not specialized; integers and pointers are divisible by 16 ("D") or not
            specialization.append((kind, None if kind.startswith(("fp", "bf")) or kind == "u1" else
                                   "D" if i in aligned else ""))
            bound[name] = None
    kwargs = dict(variant.options, debug=knobs.runtime.debug or False,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    kwargs.update({name: constexprs[i] for i, (name, kind) in enumerate(variant.signature)
                   if kind == "constexpr" and kernel.params[i].is_constexpr})
    options, signature, consts, attrs = kernel._pack_args(backend, kwargs, bound, specialization, kwargs)
    return ASTSource(kernel, signature, consts, attrs), options, target


def compile_variant(kernel, variant: Variant, arch: int):
    """Triton's compiled kernel of `variant` for compute capability `arch` (see `jit_source`)."""
    import triton

    source, options, target = jit_source(kernel, variant, arch)
    return triton.compile(source, target=target, options=options.__dict__)


def ptxas_resources(ptx: str, arch: int) -> dict:
    """Registers per thread and spill bytes of `ptx`, by Triton's bundled ptxas (`-v`)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # the arch-specific instructions Triton emits for 90
        log = subprocess.run([knobs.nvidia.ptxas.path, "-v", f"--gpu-name={gpu}", str(path), "-o",
                              str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None}


_POOL: list[tuple[Variant, Any]] = []  # the variants a forked compile process reads by index


def _compile_one(index: int, arch: int, resources: bool) -> dict:
    """Variant `index` of `_POOL` compiled. One launched with its pipeline stages given (the kernels with a
    pipelined loop, through `triton_linear.launch_fitting`) is compiled again with fewer past the shared memory
    a block may take, as that launch falls back (`num_stages` then says how many fit)."""
    variant, kernel = _POOL[index]
    limit = SHARED_MEMORY_LIMIT.get(arch)
    options = dict(variant.options)
    fits = "num_stages" in options
    while True:
        try:
            built = compile_variant(kernel, dataclasses.replace(variant, options=tuple(sorted(options.items()))), arch)
        except Exception as e:
            text = str(e).strip()
            return {"error": f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"}
        shared = int(getattr(built.metadata, "shared", 0) or 0)
        if not fits or limit is None or shared <= limit or options["num_stages"] <= 1:
            break
        options["num_stages"] -= 1
    result = {"shared_memory": shared}
    if options != dict(variant.options):
        result["num_stages"] = options["num_stages"]
    if resources:
        result |= ptxas_resources(built.asm["ptx"], arch)
    return result


def compile_variants(variants: dict[Variant, Any], arch: int, resources: bool = False, jobs: int | None = None) -> dict:
    """Compile each variant for `arch`, in `jobs` processes (default: one per CPU): how many compiled, which
    failed (a compile error, or more shared memory than a block may take even with the fewest stages), those
    that fit only with fewer stages, the most shared memory one took, and per kernel how many variants; with
    `resources`, each variant's shared memory, registers and spills."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    import triton

    _POOL[:] = list(variants.items())
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(_POOL)))
    try:
        if jobs == 1:
            results = [_compile_one(i, arch, resources) for i in range(len(_POOL))]
        else:  # forked: the children read the variants (and their kernels) from `_POOL`
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                results = list(pool.map(_compile_one, range(len(_POOL)), [arch] * len(_POOL),
                                        [resources] * len(_POOL), chunksize=4))
        labels = [variant.label() for variant, _ in _POOL]
        names = [variant.name for variant, _ in _POOL]
    finally:
        _POOL.clear()
    shared_limit = SHARED_MEMORY_LIMIT.get(arch)
    compiled, failed, most_shared, fitted = 0, [], 0, []
    per_kernel: dict[str, int] = {}
    details = []
    for label, name, result in zip(labels, names, results):
        if "error" in result:  # every failure is reported, not just the first
            failed.append(f"{label}: {result['error']}")
            continue
        shared = result["shared_memory"]
        most_shared = max(most_shared, shared)
        if shared_limit is not None and shared > shared_limit:  # the launch would raise OutOfResources
            failed.append(f"{label}: needs {shared} B of shared memory, the GPU has {shared_limit}")
            continue
        compiled += 1
        per_kernel[name] = per_kernel.get(name, 0) + 1
        if "num_stages" in result:
            fitted.append(f"{label}: {result['num_stages']} stages fit ({shared} B)")
        if resources:
            details.append({"variant": label, **result})
    report = {"arch": arch, "triton": triton.__version__, "compiled": compiled, "failed": failed,
              "most_shared_memory": most_shared, "shared_memory_limit": shared_limit, "variants_per_kernel": per_kernel,
              "fewer_stages": fitted}
    if resources:
        report["variants"] = details
    return report
