"""Rank side of hvdlite.runner.run(): load the pickled function, call it, store the outcome.

Usage: python -m hvdlite.runner._func_task WORKDIR   (started by run_func.run, one per rank)
"""
import os
import pickle
import runpy
import sys
import traceback
import types


def _load_main(path: str) -> None:
    # As multiprocessing's spawn does: the caller's main script becomes __mp_main__, so
    # functions pickled as __main__.name resolve, and its `if __name__ == "__main__"` block
    # does not run again.
    namespace = runpy.run_path(path, run_name="__mp_main__")
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__mp_main__"] = module
    sys.modules["__main__"] = module


def main(workdir: str) -> int:
    try:
        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            payload = pickle.load(f)
        if payload["main_path"]:
            _load_main(payload["main_path"])
        fn, args, kwargs = pickle.loads(payload["blob"])
        outcome = ("ok", fn(*args, **kwargs))
        code = 0
    except BaseException as exc:  # noqa: B902 - the caller gets it, whatever it is
        if isinstance(exc, SystemExit) and exc.code in (0, None) and os.environ.get("HVDLITE_ELASTIC") == "1":
            return 0  # an elastic worker that left the job: the final ranks return the results
        # Note [Failure reports]: as an uncaught exception would be
        from hvdlite._runtime import failure as _failure
        _failure.report(exc)
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        outcome = ("error", {"summary": summary, "traceback": traceback.format_exc()})
        traceback.print_exc()
        code = 1
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:
        data = pickle.dumps(("error", {"summary": f"the return value cannot be pickled: {exc}",
                                       "traceback": ""}))
        code = 1
    # Read at the end: under elastic training the rank is the one of the final generation.
    out_path = os.path.join(workdir, f"result.{int(os.environ.get('HVDLITE_RANK', '0'))}.pkl")
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
