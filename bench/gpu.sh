#!/usr/bin/env bash
# Everything Tidewire checks and times on a CUDA GPU, in one run (a lent GPU machine is
# bare and keeps nothing): the kernel tests compiled for the GPU (parity with the torch
# references, the engine against the CPU backend and HF), the engine thread's async
# output on the GPU, `bench kernels`, and `bench offline` / `bench ws` (with and without
# async output) / `bench prefix --parts overhead` (host tier none vs memory) / `bench
# cascade` (shared-prefix attention on and off) on
# random-weight models of real shapes.
#
#   bench/gpu.sh OUT_DIR [CONFIG_DIR]
# CONFIG_DIR: a model directory's config.json + tokenizer files (default: the converted
# SmolLM2 in $TIDEWIRE_CACHE); the benchmarks run random weights of that shape, and of
# Llama-3.2-1B's. PYTHON (default python3) must have torch with CUDA, triton, transformers,
# pytest (and pytest-asyncio for the engine thread's test); `bench ws` also needs the
# service's packages.
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUT_DIR [CONFIG_DIR]}
cfg=${2:-$(ls -d "${TIDEWIRE_CACHE:-$HOME/.cache/tidewire}"/smollm2-135m-* 2>/dev/null | head -1)}
py=${PYTHON:-python3}
models=${TMPDIR:-/tmp}/tidewire-gpu-models
mkdir -p "$out" "$models"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
fail=0
run() {  # name, command...: log to $out/name.log, remember a failure, go on
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$out/$name.log" || { fail=1; echo "!! $name failed"; }
    echo "== $name took $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
$py -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', \
transformers.__version__)"
run test_kernels $py -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py
run test_async_output $py -m pytest -q -rs -p no:cacheprovider tests/test_async_engine.py -k cuda
run bench_kernels $py -m service.cli bench kernels --json "$out/kernels.json"
if [ -n "$cfg" ]; then
    $py -m bench.random_model "$models/small" --config-dir "$cfg" >/dev/null || fail=1
    run offline_small $py -m service.cli bench offline --model "$models/small" --profile \
        --json "$out/offline_small.json"
    run offline_small_eager $py -m service.cli bench offline --model "$models/small" \
        --enforce-eager --skip-hf --json "$out/offline_small_eager.json"
    # shared-prefix attention on and off behind one 2,000-token system prompt (the Triton
    # backend's cost rule is still the CPU's until this is read)
    run cascade_small $py -m service.cli bench cascade --model "$models/small" --rounds 3 \
        --json "$out/cascade_small.json"
    # the host tier's cost once the device pool evicts: none vs memory, in one process
    run tier_overhead_small $py -m service.cli bench prefix --model "$models/small" \
        --parts overhead --overhead-requests 64 --overhead-rounds 9 \
        --overhead-kinds none,memory --json "$out/tier_overhead_small.json"
    if $py -c "import starlette, uvicorn, websockets" 2>/dev/null; then
        run ws_small $py -m service.cli bench ws --model "$models/small" --rounds 5 \
            --json "$out/ws_small.json"
        run ws_small_sync $py -m service.cli bench ws --model "$models/small" --rounds 5 \
            --no-async-output --json "$out/ws_small_sync.json"
        run ws_small_no_tier $py -m service.cli bench ws --model "$models/small" --rounds 5 \
            --kv-tier none --json "$out/ws_small_no_tier.json"
    fi
fi
$py -m bench.random_model "$models/llama-1b" --shape llama-1b >/dev/null || fail=1
run offline_1b $py -m service.cli bench offline --model "$models/llama-1b" \
    --json "$out/offline_1b.json"
exit $fail
