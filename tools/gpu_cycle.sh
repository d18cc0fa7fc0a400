#!/usr/bin/env bash
# The check of a kernel or dispatch change on a GPU machine, from the source tree:
#   tools/gpu_cycle.sh LOGDIR tests [PYTEST ARGS...]   the GPU tests (CUATTN_REQUIRE_GPU=1)
#   tools/gpu_cycle.sh LOGDIR sanitize [ARGS...]       tools/sanitize.py (compute-sanitizer)
#   tools/gpu_cycle.sh LOGDIR bench [ARGS...]          python -m cuattn bench
# Each stage writes its full log to LOGDIR and prints its last lines; the exit status is the
# stage's. Workers for the tests: one per core (pytest-xdist), sharing CUPY_CACHE_DIR, which
# tools/warm_cache.py first fills with the selection's instances, each compiled once. On a machine without a package index, WHEELS=DIR installs
# Dask (the dask extra, for tests/test_dask.py) from wheels brought in DIR. TESTS_LIMIT=S
# interrupts the tests after S seconds, so that pytest still prints what ran and failed.
# WARM_LIST=FILE: compile the instances listed there (a previous run's LOGDIR/instances.jsonl)
# and record the selection for only WARM_RECORD seconds (default 60); every run writes its
# list to LOGDIR/instances.jsonl. CUATTN_TEST_SHARD=i/n runs the i-th of n shards of the tests
# (tests/conftest.py), for calls too short for the whole suite.
set -uo pipefail
logdir=$1; stage=$2; shift 2
mkdir -p "$logdir"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUATTN_REQUIRE_GPU=1
if [ -n "${WHEELS:-}" ] && ! python3 -c "import dask.array, distributed" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" "dask[array,distributed]" \
    > "$logdir/wheels.log" 2>&1 || echo "installing Dask from $WHEELS failed: $logdir/wheels.log"
fi
case $stage in
  tests)
    warm=(--save "$logdir/instances.jsonl")
    [ -n "${WARM_LIST:-}" ] && warm+=(--instances "$WARM_LIST" --record-timeout "${WARM_RECORD:-60}")
    python3 tools/warm_cache.py "${warm[@]}" -- -m gpu -n "$(nproc)" "$@" 2>&1 \
      | tee "$logdir/warm.log"
    limit=(); [ -n "${TESTS_LIMIT:-}" ] && limit=(timeout -s INT "$TESTS_LIMIT")
    "${limit[@]}" python3 -m pytest -q -p no:cacheprovider -m gpu -n "$(nproc)" "$@" 2>&1 \
      | tee "$logdir/tests.log" | tail -25 ;;
  sanitize)
    python3 tools/sanitize.py --log-dir "$logdir" "$@" 2>&1 | tee "$logdir/sanitize.log" \
      | tail -15 ;;
  bench)
    python3 -m cuattn bench --json "$logdir/bench.json" --plot "$logdir/bench.png" "$@" 2>&1 \
      | tee "$logdir/bench.log" | tail -40 ;;
  *) echo "unknown stage $stage: tests, sanitize or bench" >&2; exit 2 ;;
esac
