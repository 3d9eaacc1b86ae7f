"""Triton's cache filled before the check's sections launch their kernels: the variants they will launch, compiled
in parallel on the GPU machine's CPUs (`kernels.triton_aot.compile_variants`), where each launch's JIT would
compile them one after another.

A variant compiled from the recording (`workers/kernel_variants.py`) goes into the cache under the key a launch of
the same call computes (tested in tests/workers/test_kernel_variants.py), so the sections' launches find them;
`triton_compiles` in each section's report then says how many they still compiled. Covered: the engine's steps
at SmolLM2-135M's shape in float32 and bfloat16 with the default configs, and the batch-256 and one-row decode
steps under every config the two sweeps time, the default configs the other way with programmatic dependent
launch, and the single stream unsplit (the winners' are compiled when the sweeps launch them). Not covered: the
kernel-parity cases' other shapes and block sizes.
The compiles run in a process of their own with a time limit (`python -m loadtest.gpu_check.warmup`): a hung
compile costs the check that limit, not the lease."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

WARMUP_TIMEOUT_S = 150


def gpu_arch() -> int:
    """The first GPU's compute capability as Triton names its target (90 for an H200), from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout.split()
    major, minor = out[0].split(".")
    return int(major) * 10 + int(minor)


def compile_for_the_check(arch: int, jobs: int | None, sweeps: bool) -> dict:
    """Compile the variants (see the module docstring) for `arch` in `jobs` processes (default: one per CPU);
    `sweeps=False` leaves out the sweep configs'."""
    import torch

    from kernels import triton_attention, triton_linear
    from kernels.triton_aot import compile_variants
    from loadtest.gpu_check import attention_sweep, linear_sweep
    from workers.kernel_variants import config_variants, engine_variants

    decode, linear = triton_attention.DECODE_CONFIG, triton_linear.NORM_LINEAR_CONFIG
    fused = linear or triton_linear.LinearConfig()
    configs = ([(a, linear) for a in attention_sweep.sweep_configs(False)]
               + [(decode, c) for c in linear_sweep.sweep_configs(False)]) if sweeps else []
    if sweeps:
        # the single stream unsplit (its A/B against the automatic splits), and the defaults the other way with
        # programmatic dependent launch (its A/B)
        configs += [(dataclasses.replace(decode, num_splits=1), linear),
                    (dataclasses.replace(decode, pdl=not decode.pdl), dataclasses.replace(fused, pdl=not fused.pdl))]
    if arch < 90:  # launched without it there (`triton_linear.pdl_launch`)
        configs = [(dataclasses.replace(a, pdl=False), c and dataclasses.replace(c, pdl=False)) for a, c in configs]
    variants = engine_variants(("smollm2-135m",), (torch.float32, torch.bfloat16), pdl=arch >= 90)
    # the engine's graphs (block tables 64 wide at the check's 1,024 tokens) and the sweep's own inputs (as wide
    # as a sequence's blocks)
    steps = ((256, 64), (256, 17), (1, 64), (1, 17))
    for variant, kernel in config_variants("smollm2-135m", torch.bfloat16, configs, steps).items():
        variants.setdefault(variant, kernel)
    report = compile_variants(variants, arch, jobs=jobs)
    return {"passed": not report["failed"], "arch": arch, "variants": len(variants), **report}


def warm_triton_cache(arch: int | None = None, jobs: int | None = None, sweeps: bool = True,
                      timeout_s: float = WARMUP_TIMEOUT_S) -> dict:
    """`compile_for_the_check` in a process of its own, stopped after `timeout_s`; its report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "loadtest.gpu_check.warmup", "--arch", str(arch or gpu_arch())]
    cmd += ["--jobs", str(jobs)] if jobs else []
    cmd += [] if sweeps else ["--no-sweeps"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"the warm-up did not finish within {timeout_s:.0f} s"}
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        return {"passed": False, "error": f"the warm-up exited {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu_check.warmup", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, required=True, help="CUDA compute capability, e.g. 90 (no default)")
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU)")
    p.add_argument("--no-sweeps", dest="sweeps", action="store_false",
                   help="leave out the sweep configs' variants (default: in)")
    args = p.parse_args(argv)
    report = compile_for_the_check(args.arch, args.jobs, args.sweeps)
    print(json.dumps(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
