#!/usr/bin/env bash
# Everything a lent GPU checks, in one call of the `device` tool (about 6 of its 7 minutes on an H200):
#
#   here:   .venv/bin/python -m loadtest.gpu_check --prepare .gpu_check/model
#   device: bash loadtest/gpu_check/device_run.sh         (carry [".gpu_check"], timeout_s 420)
#
# The check's JSON and log, the host-step timings, the GPU tests' output and nvidia-smi land in $OUT. Each part
# has its own time limit, so a hung part still leaves the others' results; the JSON is written after every
# section. The parts run most important first: if the call's own limit cuts the last, it is the GPU tests, whose
# kernels the check's parity and sweep sections also compare (the last lease's 67 tests took 54 s, most of it
# compiling).
set -u
: "${OUT:?set OUT to the folder for the results}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/../.."
# at most 8 files come back from $OUT: nvidia-smi (with the commit), the check's JSON and log, three host-step
# JSONs and the tests' output; the host-step logs stay in /tmp, their last lines printed
{ git log -1 --format='commit %H %s' 2>/dev/null; nvidia-smi; } > "$OUT/nvidia-smi.txt" 2>&1
timeout 300 python3 -m loadtest.gpu_check --model .gpu_check/model --out "$OUT" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check exit $?"
tail -45 "$OUT/gpu_check.log"
# the engine's own Python per decode step on this machine's CPU, the model on the GPU (graphs on), each with
# a last round under Python's profiler (in the JSON) and the thread's CPU time per phase: the last lease's
# async process ran every phase slower than the in-turn one, the same Python included
timeout 75 python3 -m loadtest.host_step --device cuda --tokenizer .gpu_check/model --output-kind final \
    --rounds 3 --steps 48 --profile --out "$OUT" > /tmp/host_step.log 2>&1
echo "host_step exit $?"
# the same without async scheduling (each step queued once the one before is done): the A/B
timeout 60 python3 -m loadtest.host_step --device cuda --tokenizer .gpu_check/model --output-kind final \
    --rounds 2 --steps 48 --no-async-scheduling --profile --out "$OUT" > /tmp/host_step_in_turn.log 2>&1
echo "host_step in turn exit $?"
# streamed (delta) outputs, as the server makes them: what making a step's outputs costs on this CPU
timeout 60 python3 -m loadtest.host_step --device cuda --tokenizer .gpu_check/model --output-kind delta \
    --rounds 2 --steps 48 --out "$OUT" > /tmp/host_step_delta.log 2>&1
echo "host_step delta exit $?"
grep -h -A1 "^round\|^median" /tmp/host_step.log /tmp/host_step_in_turn.log /tmp/host_step_delta.log
# the Triton kernels and the CUDA IPC hand-off, on the GPU (the AOT sm_90 compile is CI's, on the CPU)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
    tests/kernels/test_triton_layer_ops.py tests/kernels/test_triton_linear.py tests/workers/test_kv_transfer_cuda_ipc.py \
    > "$OUT/pytest.txt" 2>&1
echo "pytest exit $?"
tail -3 "$OUT/pytest.txt"
