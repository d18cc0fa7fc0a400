"""Fill CuPy's on-disk kernel cache with the instances a pytest selection (or a module run
with ``python -m``) uses, each compiled once, in parallel:

    python3 tools/warm_cache.py [-j JOBS] -- PYTEST ARGS...
    python3 tools/warm_cache.py [-j JOBS] --module cuattn -- bench --suite train --no-peers
    python3 tools/warm_cache.py --instances LIST --record-timeout 60 --save LIST -- ...

A GPU test run is bound by NVRTC: every xdist worker meets the same uncached instances at
about the same time and compiles them again. This tool first runs the selection with every
compile replaced by a recorder whose kernels launch nothing, under ``python -O`` and with
NumPy's testing asserts switched off, so that a test goes on past its wrong results to the
calls after them (a backward after its forward's check); times are meaningless and only the
list of instances matters. It then compiles the distinct instances across JOBS processes
through the loader, so that the real run finds each one in ``CUPY_CACHE_DIR``.

Recording a whole GPU suite takes minutes (the tests' float64 references run on the host):
``--save`` writes the instances that compiled (one JSON line each) and ``--instances``
compiles a saved list as well, so a fresh machine can compile the last run's list while a short
recording adds what the tests meet anew. A listed instance that no test uses any more costs
its compile and nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD_DIR = "CUATTN_RECORD_DIR"


class _NoLaunch:
    """Stands in for a compiled kernel: accepts the attributes and calls a RawKernel gets,
    including the function pointer a :class:`cuattn._launch.Launch` is built from."""
    max_dynamic_shared_size_bytes = 0
    kernel = types.SimpleNamespace(ptr=0)

    def __call__(self, *args, **kwargs):
        pass


def _no_launch(self, *args, **kwargs):  # Launch.__call__ while recording: nothing runs
    pass


def pytest_configure(config):  # the recorder, loaded into each pytest process with -p
    install_recorder()


def install_recorder():
    """In a process started by this tool: compiles are recorded, launches do nothing."""
    directory = os.environ.get(RECORD_DIR)
    if not directory:
        return
    import numpy.testing

    from cuattn import _kernels, _launch
    # a call goes on past every launch, so its later kernels (a backward's, a merge's) are
    # recorded too
    _launch.Launch.__call__ = _no_launch
    for name in ("assert_allclose", "assert_array_equal", "assert_equal", "assert_array_less",
                 "assert_array_almost_equal", "assert_almost_equal"):
        setattr(numpy.testing, name, lambda *args, **kwargs: None)
    path = Path(directory) / f"{os.getpid()}.jsonl"
    seen = set()

    def record(device_id, folder, filename, name_expression, options):
        key = (folder, filename, name_expression, list(options))
        text = json.dumps(key)
        if text not in seen:
            seen.add(text)
            with path.open("a") as f:  # a line at once: a killed run keeps what it found
                f.write(text + "\n")
        return _NoLaunch()

    _kernels._module = record


def _compile(folder, filename, name_expression, options):
    from cuattn import _kernels
    t0 = time.perf_counter()
    try:
        _kernels._module(0, folder, filename, name_expression, tuple(options))
    except Exception as exc:  # noqa: BLE001 - reported, and met again by the real run
        return name_expression, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:300]
    return name_expression, time.perf_counter() - t0, None


def _portable(key) -> str:
    """A recorded instance as one JSON text, its kernel folder relative to the checkout
    (a list travels to another machine, whose checkout lies elsewhere)."""
    folder, *rest = key
    try:
        folder = str(Path(folder).resolve().relative_to(ROOT))
    except ValueError:  # a folder outside the checkout (CUATTN_KERNEL_DIR) stays as it is
        pass
    return json.dumps([folder, *rest])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--record-timeout", type=float, default=300.0,
                        help="seconds the recording run may take (default 300)")
    parser.add_argument("--module", help="record `python -m MODULE ARGS` instead of pytest")
    parser.add_argument("--instances", type=Path,
                        help="also compile the instances listed in this file (from --save)")
    parser.add_argument("--save", type=Path, help="write the instances that compiled here")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="pytest's or the module's")
    args = parser.parse_args(argv)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.module:
        command = [sys.executable, "-O", "-c", "import sys, runpy, warm_cache; "
                   "warm_cache.install_recorder(); sys.argv[0] = sys.argv[1]; del sys.argv[1]; "
                   "runpy.run_module(sys.argv[0], run_name='__main__')", args.module, *rest]
    else:
        command = [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-p", "warm_cache", *rest]
    with tempfile.TemporaryDirectory() as directory:
        # PYTHONOPTIMIZE as well as -O: pytest-xdist's workers are new interpreters
        env = dict(os.environ, **{RECORD_DIR: directory, "PYTHONOPTIMIZE": "1"})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tools"),
                                                          env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        if args.record_timeout > 0:
            # a session of its own, so that a timeout stops pytest-xdist's workers as well
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                proc.wait(timeout=args.record_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                print(f"recording stopped after {args.record_timeout:.0f} s; "
                      "warming what it found")
        keys = set()
        for f in Path(directory).glob("*.jsonl"):
            keys.update(f.read_text().splitlines())
    recorded = {_portable(json.loads(k)) for k in keys}
    listed = set()
    if args.instances is not None:
        if args.instances.is_file():
            listed = {_portable(json.loads(line))
                      for line in args.instances.read_text().splitlines() if line.strip()}
        else:
            print(f"no instance list at {args.instances}: warming the recording alone")
    instances = sorted({*recorded, *listed})
    print(f"recorded {len(recorded)} instances in {time.perf_counter() - t0:.0f} s; "
          f"{len(instances)} with the list")
    t0, failed, total, compiled = time.perf_counter(), [], 0.0, []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_compile, str(ROOT / folder), *rest): text
                   for text, (folder, *rest) in zip(instances, map(json.loads, instances))}
        for future in as_completed(futures):
            name, seconds, error = future.result()
            total += seconds
            if error:
                failed.append(f"{name}: {error}")
            else:
                compiled.append(futures[future])
    if args.save is not None:  # what compiled: a stale name drops out of the list
        args.save.write_text("".join(i + "\n" for i in sorted(compiled)))
    print(f"compiled {len(instances)} instances in {time.perf_counter() - t0:.0f} s "
          f"({total:.0f} s of compile over {args.jobs} processes); {len(failed)} failed")
    for line in failed:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
