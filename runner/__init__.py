"""hvdlite.runner: the hvdliterun launcher and hvdlite.runner.run().

Map of the package (one concept per file):
  launch.py        command line -> JobConfig -> run_job; the hvdliterun entry point
  config.py        the typed job configuration; flags -> HVDLITE_* core variables
  config_file.py   --config-file: horovodrun's YAML keys -> flags
  hosts.py         -H / --hostfile / SLURM allocation parsing and the pure slot assignment
  environment.py   each rank's environment (the contract with hvd.init(), horovodrun's and
                   torchrun's names; the rules themselves live in hvdlite/_job/)
  rendezvous.py    the secret-protected key-value server (its wire protocol, client and
                   SecretStore live in the library: hvdlite/_job/wire.py, _runtime/store.py)
  network.py       interface addresses, local-host detection, free ports
  discovery.py     network discovery: which interfaces every host reaches every host through
  task_service.py  the task network discovery starts on each host (reports, probes its ring
                   neighbours)
  workers.py       starting local and remote ranks, signals, stopping them all
  agents.py        the launcher's side of a remote host's agent: one ssh per host
  agent.py         the agent itself (python -m hvdlite.runner.agent) and its frames
  lifetime.py      children that die with their parent
  output.py        rank-prefixed output and per-rank files
  io_loop.py       the one thread that reads every rank's pipes and sees every rank's exit
  errors.py        job results and the root-cause message
  session.py       what both launchers set up alike: the store, the base environment,
                   starting processes, the teardown
  job.py           one static job from start to end
  elastic.py       elastic mode: the driver (a worker-state machine), and host discovery
                   (the user's script)
  elastic_plan.py  elastic mode's pure decisions: discovery output, blacklist, ranks per generation
  run_func.py      run(fn, np=...) for Python functions
  _func_task.py    the rank side of run(): load the function, run it, write its result
  check_build.py   hvdliterun --check-build
The launcher's exceptions are defined with every other in hvdlite/exceptions.py.
"""
from hvdlite.exceptions import JobFailedError
from .run_func import run

__all__ = ["run", "JobFailedError"]
