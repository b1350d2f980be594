#!/usr/bin/env bash
# One prepared run of every check that needs a CUDA GPU (the `device` tool's machines, or any
# machine with a GPU, a CUDA build of torch and numba-cuda): the real-GPU tests (with the pin
# and device tests that run on a GPU too: test_device.py, test_pin_stage.py), then
# bench_h2d.py at 16 MiB and 4 MiB, then pinned_non_blocking.py and pin_training_step.py. With
# OLD=path/to/a/copy/of/arena_loader's/parent, the 16 MiB bench runs for that code first, in
# the same call (a same-machine A/B).
#
# On the device tool's machines posix_ipc is missing; fetch its wheel here first, into a
# folder git ignores, and carry it (device README):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl posix_ipc
#   (optional A/B) mkdir -p .whl/old && git archive <rev> arena_loader | tar -x -C .whl/old
#   run (carry [".whl"]): bash benchmarks/gpu_check.sh, or OLD=.whl/old bash benchmarks/gpu_check.sh
#   (optional) cp ../shared/reference/floor.py .whl/ and FLOOR=.whl/floor.py: floor.py on the
#   machine's 16 cores at the end (docs/benchmarks.md, nineteenth session: 0.71x there)
# About 4 minutes on an H100 (its start not counted).
set -u
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-/tmp}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || echo "(.whl not installed: using this Python's packages)"
fi
SITE=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
uname -a  # (the tool's machines have run on Firecracker and on gVisor: system calls cost more)
export PYTHONPATH=$SITE:$PWD
timeout 180 python3 -m pytest -p no:cacheprovider -n 0 -q -ra --timeout 60 \
    tests/test_device_gpu.py tests/test_device.py tests/test_pin_stage.py 2>&1 | tee "$OUTDIR/gpu_tests.log" | tail -15
if [ -n "${OLD:-}" ]; then
    echo "== old code ($OLD), 16 MiB"
    PYTHONPATH=$SITE:$PWD/$OLD timeout 150 python3 benchmarks/bench_h2d.py 2>&1 \
        | tee "$OUTDIR/h2d_old.log" | grep -v environment
fi
echo "== this code, 16 MiB"
timeout 150 python3 benchmarks/bench_h2d.py 2>&1 | tee "$OUTDIR/h2d_16.log" | grep -v environment
echo "== this code, 4 MiB"
timeout 150 python3 benchmarks/bench_h2d.py --batch-mib 4 --batches 1600 2>&1 \
    | tee "$OUTDIR/h2d_4.log" | grep -v environment
echo "== pin_memory batches under late non_blocking copies"
timeout 60 python3 benchmarks/pinned_non_blocking.py 2>&1 | tee "$OUTDIR/pinned.log"
echo "== a training loop fed with pin_memory batches"
timeout 150 python3 benchmarks/pin_training_step.py 2>&1 | tee "$OUTDIR/pin_step.log"
if [ -n "${FLOOR:-}" ]; then  # FLOOR=path/to/a/copy/of/shared/reference/floor.py (carried)
    echo "== floor.py on this machine's cores"
    (cd /tmp && timeout 150 python3 "$OLDPWD/$FLOOR" --rounds 3 2>&1 | tail -3)
fi
