"""hvdlite.runner: the hvdliterun launcher and hvdlite.runner.run().

Map of the package (one concept per file):
  launch.py       command line -> JobConfig -> run_job; the hvdliterun entry point
  config.py       the typed job configuration; flags -> HVDLITE_* core variables
  hosts.py        -H / --hostfile parsing and the pure slot assignment
  environment.py  each rank's environment (the contract with hvd.init() and torchrun names)
  rendezvous.py   the secret-protected key-value server (its wire protocol, client and
                  SecretStore live in the library: hvdlite/_rendezvous_wire.py, _store.py)
  network.py      interface addresses, local-host detection, free ports
  workers.py      starting local and ssh ranks, signals, stopping them all
  output.py       rank-prefixed output and per-rank files
  errors.py       job results and the root-cause message
  job.py          one job from start to end
  run_func.py     run(fn, np=...) for Python functions
  check_build.py  hvdliterun --check-build
"""
from .errors import RankFailedError
from .run_func import run

__all__ = ["run", "RankFailedError"]
