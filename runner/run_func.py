"""hvdlite.runner.run(fn, np=...): run a Python function on N local ranks, collect the results.

The function travels to the ranks pickled by reference (module and name), so it must be
importable there: a module-level function of an importable module, or of the main script
(which each rank re-imports under the name __mp_main__, as multiprocessing does; guard the
script's own work with `if __name__ == "__main__":`). Each rank runs `_func_task.py`, which
writes its return value or its traceback next to the pickled function.
"""
import os
import pickle
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .config import DEFAULT_ELASTIC_TIMEOUT, DEFAULT_START_TIMEOUT, ElasticConfig, JobConfig
from hvdlite.exceptions import JobFailedError

from .errors import JobResult


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Mapping] = None,
        np: int = 2, env: Optional[Mapping[str, str]] = None,
        start_timeout: float = DEFAULT_START_TIMEOUT, verbose: bool = False,
        output_dir: Optional[str] = None, *, host_discovery_script: Optional[str] = None,
        min_np: Optional[int] = None, max_np: Optional[int] = None, slots_per_host: int = 1,
        elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT, reset_limit: Optional[int] = None,
        blacklist_cooldown_range: Optional[Tuple[float, float]] = None) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `np` local ranks; return the results in rank order.

    With `host_discovery_script` the job is elastic, as hvdliterun's flags of the same names
    make it (the hosts must be this machine's names, e.g. 127.0.0.x): `fn` then usually calls
    an ``hvd.elastic.run`` function, and the results are those of the final generation's
    ranks, in rank order.

    Each rank has the same environment as under hvdliterun (plus `env`), so `fn` can call
    hvd.init(). Rank output is streamed with rank prefixes to this process's stdout/stderr.
    Raises JobFailedError naming the first rank that failed and its exception; a Ctrl-C
    stops every rank and raises KeyboardInterrupt. Synchronizes nothing itself: it only
    starts processes and waits for them.
    """
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"np must be a positive int, got {np!r}")
    from .job import run_job

    workdir = tempfile.mkdtemp(prefix="hvdlite-run-")
    try:
        _write_payload(workdir, fn, tuple(args), dict(kwargs or {}))
        extra = dict(env or {})
        # The function is pickled by reference: the ranks need this process's import path.
        parent_path = [p for p in sys.path if p]
        existing = extra.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        extra["PYTHONPATH"] = os.pathsep.join(parent_path + ([existing] if existing else []))
        elastic = None
        if host_discovery_script is not None:
            elastic = ElasticConfig(host_discovery_script, min_np=min_np or np, max_np=max_np,
                                    slots_per_host=slots_per_host, timeout=elastic_timeout,
                                    reset_limit=reset_limit, cooldown_range=blacklist_cooldown_range)
        config = JobConfig(
            command=[sys.executable, "-m", "hvdlite.runner._func_task", workdir],
            np=np, start_timeout=start_timeout, output_dir=output_dir, extra_env=extra,
            verbose=verbose, elastic=elastic,
        )
        config.knobs.verbose = verbose
        result = run_job(config)
        if result.stopped_by_signal == signal.SIGINT:
            raise KeyboardInterrupt
        if not result.ok:
            raise _failure(result, workdir)
        if elastic is not None:
            done = sorted(int(name.split(".")[1]) for name in os.listdir(workdir)
                          if name.startswith("result.") and name.endswith(".pkl"))
            return [_read_result(workdir, rank) for rank in done]
        return [_read_result(workdir, rank) for rank in range(np)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _write_payload(workdir: str, fn: Callable, args: tuple, kwargs: Dict) -> None:
    main = sys.modules.get("__main__")
    main_path = getattr(main, "__file__", None) if fn.__module__ == "__main__" else None
    try:
        blob = pickle.dumps((fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"run() cannot send {fn!r} to the ranks: {exc}. Pass a module-level function "
            f"(not a lambda or nested function) and picklable arguments.") from None
    with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
        pickle.dump({"main_path": main_path, "blob": blob}, f)


def _read_result(workdir: str, rank: int) -> Any:
    with open(os.path.join(workdir, f"result.{rank}.pkl"), "rb") as f:
        status, value = pickle.load(f)
    return value


def _failure(result: JobResult, workdir: str) -> JobFailedError:
    """The exception run() raises: the root cause's summary (Note [Root cause] in errors.py)
    and that rank's traceback."""
    ranks = result.cause_ranks() if result.root_cause is not None else []
    if not ranks:
        return JobFailedError(f"hvdlite.runner.run: {result.message()}", result=result)
    detail = ""
    path = os.path.join(workdir, f"result.{ranks[0]}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            detail = f"\n\n{value['traceback']}"
    return JobFailedError(f"hvdlite.runner.run: {result.message()}{detail}", rank=ranks[0],
                           result=result)
