#!/usr/bin/env bash
# One device call of the true-depth end-to-end study: `bench/e2e_device.sh NAME MODES [e2e.py args]`.
# Installs the serving wheels carried in .whl (the device image lacks fastapi/uvicorn), keeps Triton's
# cache in .triton_cache (carry it into the next call: compiles cost 1-2 minutes a call at true depth)
# and returns it as $OUT/triton_cache.tgz. TESTS="test files" (and TESTS_K="a -k expression"): run those
# CUDA tests first and stop if they fail; AFTER="a command": run it after the study (e.g. a short benchmark).
# Set ASYMPD_COMMIT to the commit checked out (the device copy has no git history).
set -uo pipefail
out=${OUT:?set OUT to the output folder}
# the result's commit field: a full hash, or the run is not worth its device minutes (a short or
# mistyped one had to be corrected by hand twice; source_digest is what identifies the code exactly)
if ! [[ ${ASYMPD_COMMIT:-} =~ ^[0-9a-f]{40}(\+dirty)?$ ]]; then
    echo "set ASYMPD_COMMIT to the full hash of the checkout (git rev-parse HEAD), not '${ASYMPD_COMMIT:-}'" >&2
    exit 2
fi
export PYTHONPATH=.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:.
fi
export TRITON_CACHE_DIR=$PWD/.triton_cache PYTHONUNBUFFERED=1 ASYMPD_OUT=$out
mkdir -p "$TRITON_CACHE_DIR"
echo "triton cache carried in: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
name=$1 modes=$2
shift 2
if [ -n "${TESTS:-}" ]; then
    # shellcheck disable=SC2086
    python3 -m pytest -x -rA -p no:cacheprovider $TESTS -k "${TESTS_K:-}" >"$out/cuda_tests_$name.log" 2>&1
    rc=$?
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed|CUDA graphs|graphs,|agree" "$out/cuda_tests_$name.log" | tail -30
    echo "CUDA tests exit $rc"
    [ "$rc" -eq 0 ] || exit "$rc"
fi
python3 bench/e2e.py --gpus 1 --depth 40 --modes "$modes" --name "$name" "$@" 2>&1 | tee "$out/$name.log"
rc=${PIPESTATUS[0]}
if [ -n "${AFTER:-}" ]; then  # one more command in the same call (its output beside the study's)
    bash -c "$AFTER" >"$out/after_$name.log" 2>&1
    echo "AFTER exit $?: $(tail -3 "$out/after_$name.log")"
fi
tar czf "$out/triton_cache.tgz" .triton_cache
echo "triton cache returned: $(du -sh "$out/triton_cache.tgz" | cut -f1)"
exit "$rc"
