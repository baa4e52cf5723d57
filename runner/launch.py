"""hvdliterun: the command line. Parses arguments into a JobConfig and calls run_job.

Nothing else happens here: the job lives in job.py, hosts in hosts.py, and so on.
"""
import argparse
import os
import sys
from typing import List, NoReturn, Optional, Sequence, Tuple

from hvdlite.exceptions import UsageError

from .config import (DEFAULT_ELASTIC_TIMEOUT, DEFAULT_GRACE_PERIOD, DEFAULT_START_TIMEOUT,
                     CoreKnobs, ElasticConfig, JobConfig, SshOptions)
from .hosts import HostSpecError, parse_host_list, parse_hostfile, slurm_allocation
from .network import NetworkError

PROG = "hvdliterun"

DESCRIPTION = """\
Start a data-parallel job of N ranks on one or more hosts.

Each rank runs COMMAND with its place in the job in its environment, which hvd.init() reads
(and plain torch.distributed code too, through torchrun's names). Every line a rank prints
reaches this terminal prefixed with its rank: "[1]<stdout>: ..." or "[1]<stderr>: ...".

Without -H or --hostfile all ranks run on this machine, or, inside a SLURM allocation
(salloc, sbatch), on the allocation's hosts. Hosts named localhost, 127.x.x.x or
this machine's own names and addresses run locally; every other host is reached with ssh
(which must log in without a password), in the same working directory, with this launcher's
environment forwarded.

When a rank exits with a non-zero code, the other ranks get SIGTERM, then SIGKILL after a
grace period, and hvdliterun prints the rank, its host and exit code and exits with that code.
Ctrl-C or SIGTERM to hvdliterun stops every rank, local and remote; if hvdliterun itself is
killed, every rank stops within seconds.

On more than one host, hvdliterun first runs network discovery: a small task on every host
lists its interfaces and probes the others, and the ranks then use only interfaces through
which every host reaches every other host (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), with the
rendezvous on an address every host reaches. --network-interfaces chooses them instead."""

EPILOG = """\
examples:
  hvdliterun -np 4 python train.py
      four ranks on this machine
  hvdliterun -np 8 -H node1:4,node2:4 python train.py --epochs 10
      ranks 0-3 on node1, 4-7 on node2 (ssh to each)
  hvdliterun --hostfile hosts.txt -p 2222 -i ~/.ssh/id_cluster python train.py
      every slot listed in hosts.txt; hosts.txt holds lines like "node1 slots=4"
      (# starts a comment)
  hvdliterun -np 2 --output-filename logs/ --fusion-threshold-mb 32 python train.py
      also writes logs/rank.0/stdout, logs/rank.0/stderr, logs/rank.1/...
  hvdliterun --host-discovery-script ./hosts.sh --min-np 2 --max-np 8 python train.py
      elastic: the job follows the hosts hosts.sh prints ("node1:4" per line), and keeps
      training when ranks die (the script uses hvdlite.elastic); output lines are then
      prefixed with a worker number, stable for the worker's life, as ranks change
  hvdliterun --check-build
      what this installation supports

environment of each rank:
  HVDLITE_RANK, HVDLITE_SIZE, HVDLITE_LOCAL_RANK, HVDLITE_LOCAL_SIZE,
  HVDLITE_CROSS_RANK, HVDLITE_CROSS_SIZE    place in the job; ranks fill hosts in order
  HVDLITE_HOSTNAME                          the host name the rank was assigned
  HVDLITE_RENDEZVOUS_ADDR, _PORT, _SECRET   the launcher's secret-protected store
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                                            torchrun's names, for plain torch.distributed;
                                            MASTER_PORT differs from the rendezvous port
  plus HVDLITE_FUSION_THRESHOLD, HVDLITE_CYCLE_TIME, HVDLITE_CPU_CHANNELS, HVDLITE_TIMELINE, HVDLITE_AUTOTUNE,
  HVDLITE_AUTOTUNE_LOG, HVDLITE_LOG_LEVEL, HVDLITE_STALL_CHECK_TIME_SECONDS,
  HVDLITE_STALL_SHUTDOWN_TIME_SECONDS from the flags above.

exit status:
  0 when every rank exits 0; the first failing rank's exit code (1 if it was killed by a
  signal); 128+N when stopped by signal N; 2 for a bad command line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _float_at_least(text: str, minimum: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > minimum if strict else value >= minimum) or value == float("inf"):
        wanted = "a positive number" if strict else f"a number >= {minimum:g}"
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _float_at_least(text, 0.0, strict=True)


def _non_negative_float(text: str) -> float:
    return _float_at_least(text, 0.0, strict=False)


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {value}")
    return value


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _log_level(text: str) -> str:
    level = {"fatal": "error"}.get(text.lower(), text.lower())
    if level not in ("trace", "debug", "info", "warning", "error"):
        raise argparse.ArgumentTypeError(f"expected trace, debug, info, warning, error or fatal, got {text!r}")
    return level


def _channels(text: str) -> int:
    value = _positive_int(text)
    if value > 16:
        raise argparse.ArgumentTypeError(f"at most 16 channels, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                usage=f"{PROG} [-np N] [-H HOSTS | --hostfile FILE] [options] COMMAND [ARGS...]")
    job = p.add_argument_group("job")
    job.add_argument("-np", "--num-proc", dest="np", type=_positive_int, metavar="N",
                     help="number of ranks (default: every slot of -H/--hostfile; "
                          "required without them)")
    where = job.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and how many ranks each takes, e.g. node1:4,node2:4; "
                            "a host without :SLOTS takes one")
    where.add_argument("--hostfile", metavar="FILE",
                       help='file with one "HOST slots=N" per line; # starts a comment')
    job.add_argument("--start-timeout", type=_positive_float, default=DEFAULT_START_TIMEOUT,
                     metavar="SECONDS",
                     help="ranks must reach the rendezvous (hvd.init()) within this time, "
                          "else the job stops naming the ranks that did not; dropped when "
                          "no rank uses the rendezvous, as plain torch.distributed code "
                          f"does (default: {DEFAULT_START_TIMEOUT:g})")
    job.add_argument("--grace-period", type=_positive_float, default=DEFAULT_GRACE_PERIOD,
                     metavar="SECONDS",
                     help="time between SIGTERM and SIGKILL when stopping ranks "
                          f"(default: {DEFAULT_GRACE_PERIOD:g})")
    job.add_argument("--output-filename", metavar="DIR",
                     help="also write each rank's output, without prefixes, to "
                          "DIR/rank.N/stdout and DIR/rank.N/stderr")
    job.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                     metavar="IF1,IF2",
                     help="the interfaces ranks use to reach each other (GLOO_SOCKET_IFNAME, "
                          "NCCL_SOCKET_IFNAME) instead of network discovery, as horovodrun's flag; "
                          "the rendezvous is served on the first one's IPv4 address")
    job.add_argument("--no-network-discovery", action="store_true",
                     help="on many hosts: skip network discovery and leave the choice of "
                          "interfaces to Gloo and NCCL's defaults")
    job.add_argument("--dump", nargs="?", const="", metavar="JOB_DIR",
                     help="instead of starting a job: make a running one (the newest on this machine, "
                          "or the one whose job directory is JOB_DIR) write a flight-recorder dump, and "
                          "print the merged report: pending collectives, missing ranks and where they are")
    job.add_argument("--verbose", action="store_true",
                     help="log what the launcher does and set HVDLITE_LOG_LEVEL=debug")
    job.add_argument("-cb", "--check-build", action="store_true",
                     help="print what this installation supports (torch, Gloo, NCCL, CUDA) "
                          "and exit")

    ssh = p.add_argument_group("ssh (for hosts other than this one)")
    ssh.add_argument("-p", "--ssh-port", type=_port, metavar="PORT", help="ssh port")
    ssh.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key")
    ssh.add_argument("--ssh-config-file", metavar="FILE",
                     help="ssh configuration file (ssh -F), e.g. for keys and known hosts")

    core = p.add_argument_group("hvdlite core settings (become HVDLITE_* variables)")
    core.add_argument("--fusion-threshold-mb", type=_non_negative_float, metavar="MB",
                      help="fuse small tensors into buffers up to this size; 0 disables fusion "
                           "(HVDLITE_FUSION_THRESHOLD, in bytes; core default 64)")
    core.add_argument("--cycle-time-ms", type=_non_negative_float, metavar="MS",
                      help="shortest time between two busy negotiation rounds; 0 runs each round "
                           "as soon as the previous one ends (HVDLITE_CYCLE_TIME)")
    core.add_argument("--cpu-channels", type=_channels, metavar="N",
                      help="Gloo process groups for CPU data; large allreduces are striped over "
                           "them (HVDLITE_CPU_CHANNELS, 1-16; core default 4)")
    core.add_argument("--hierarchical-allreduce", action="store_true",
                      help="reduce CPU tensors inside each host first, then across hosts among one "
                           "rank per host (HVDLITE_HIERARCHICAL_ALLREDUCE=1)")
    core.add_argument("--timeline-filename", metavar="FILE",
                      help="write a Chrome trace timeline (HVDLITE_TIMELINE)")
    core.add_argument("--autotune", action="store_true",
                      help="search fusion threshold and cycle time during the first seconds of "
                           "training and keep the best (HVDLITE_AUTOTUNE=1)")
    core.add_argument("--autotune-log-file", metavar="FILE",
                      help="rank 0 writes every autotune sample and the choice to this CSV "
                           "file (HVDLITE_AUTOTUNE_LOG)")
    core.add_argument("--stall-check-time-seconds", "--stall-check-warning-time-seconds",
                      dest="stall_check_time_seconds", type=_positive_float, metavar="SECONDS",
                      help="warn about ranks that have not submitted a tensor the others wait "
                           "on after this long (HVDLITE_STALL_CHECK_TIME_SECONDS)")
    core.add_argument("--stall-shutdown-time-seconds", "--stall-check-shutdown-time-seconds",
                      dest="stall_shutdown_time_seconds", type=_positive_float, metavar="SECONDS",
                      help="fail the job after a stall this long "
                           "(HVDLITE_STALL_SHUTDOWN_TIME_SECONDS)")
    core.add_argument("--no-stall-check", dest="stall_check", action="store_false", default=None,
                      help="no stall warnings or failures (both times 0)")
    core.add_argument("--straggler-report", type=_positive_float, metavar="SECONDS",
                      dest="straggler_report_seconds",
                      help="rank 0 logs the consistently slowest rank this often "
                           "(HVDLITE_STRAGGLER_REPORT_SECONDS)")
    core.add_argument("--metrics-port", type=_port, metavar="BASE",
                      help="each rank serves Prometheus metrics on BASE + its local rank "
                           "(HVDLITE_METRICS_PORT; needs prometheus_client)")
    core.add_argument("--cache-capacity", type=_non_negative_int, metavar="N",
                      help="names remembered by the response cache (HVDLITE_CACHE_CAPACITY)")
    core.add_argument("--disable-cache", action="store_true",
                      help="no response cache (HVDLITE_CACHE_CAPACITY=0)")
    core.add_argument("--log-level", type=_log_level, metavar="LEVEL",
                      help="trace, debug, info, warning, error (fatal reads as error) "
                           "(HVDLITE_LOG_LEVEL)")
    core.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                      help="accepted for horovodrun's job scripts: hvdlite's timeline always marks "
                           "its negotiation rounds")

    elastic = p.add_argument_group(
        "elastic training (with hvdlite.elastic in the script; see the README)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="a command that prints the usable hosts, one 'HOST' or 'HOST:SLOTS' "
                              "per line; run every second, and the job grows and shrinks with "
                              "its output (elastic mode; replaces -H/--hostfile)")
    elastic.add_argument("--min-np", type=_positive_int, metavar="N",
                         help="fewest ranks the job runs with (default: -np, else 1)")
    elastic.add_argument("--max-np", type=_positive_int, metavar="N",
                         help="most ranks the job runs with (default: every discovered slot)")
    elastic.add_argument("--slots-per-host", type=_positive_int, metavar="N",
                         help="slots of a discovered host printed without ':SLOTS' (default 1)")
    elastic.add_argument("--elastic-timeout", type=_positive_float, metavar="SECONDS",
                         help="how long to wait for --min-np slots before stopping the job "
                              "(default 600)")
    elastic.add_argument("--reset-limit", type=_non_negative_int, metavar="N",
                         help="stop the job instead of resetting it more than N times")
    elastic.add_argument("--blacklist-cooldown-range", type=_non_negative_float, nargs=2,
                         metavar=("LO", "HI"),
                         help="a host whose worker failed comes back after a cooldown drawn "
                              "from [LO, HI] seconds, doubled at each repeat (default: never)")

    compat = p.add_argument_group("horovodrun compatibility")
    compat.add_argument("--config-file", metavar="FILE",
                        help="horovodrun's YAML configuration file (needs PyYAML); flags given "
                             "here win over it")
    compat.add_argument("--prefix-output-with-timestamp", action="store_true",
                        help="add the time to every rank's output line")
    compat.add_argument("-v", "--version", action="store_true",
                        help="print hvdlite's version and exit")
    compat.add_argument("--gloo-timeout-seconds", type=_positive_float, metavar="SECONDS",
                        help="the process groups' timeout (HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS)")
    compat.add_argument("--log-hide-timestamp", "--log-without-timestamp", action="store_true",
                        help="accepted: hvdlite's log lines carry no timestamp")
    compat.add_argument("--gloo", action="store_true",
                        help="accepted: Gloo (with NCCL for CUDA tensors) is hvdlite's only controller")
    compat.add_argument("--mpi", action="store_true", help=argparse.SUPPRESS)
    compat.add_argument("--jsrun", action="store_true", help=argparse.SUPPRESS)

    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                   help="the program every rank runs, with its arguments")
    return p


def parse_config(argv: Sequence[str]) -> Tuple[Optional[JobConfig], argparse.Namespace]:
    """Parse argv into a JobConfig (None for --check-build). Raises UsageError."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.mpi or args.jsrun:
        flag = "--mpi" if args.mpi else "--jsrun"
        raise UsageError(f"{flag}: hvdlite has no MPI or jsrun controller; hvdliterun starts the ranks "
                         "itself (drop the flag), and jobs under mpirun or jsrun can call hvd.init() "
                         "directly")
    if args.version or args.check_build or args.dump is not None:
        return None, args
    if args.config_file:
        from .config_file import ConfigFileError, read
        try:
            from_file = read(args.config_file)
        except ConfigFileError as exc:
            raise UsageError(str(exc)) from None
        defaults = vars(parser.parse_args(["x"]))
        for dest, value in from_file.items():
            if getattr(args, dest, None) == defaults.get(dest):  # not given on the command line
                setattr(args, dest, _log_level(str(value)) if dest == "log_level" else value)
    command: List[str] = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("missing COMMAND: what should every rank run?")
    if command[0].startswith("-"):
        raise UsageError(f"unknown option {command[0]!r}")
    elastic = _elastic_config(args)
    try:
        if elastic is not None:
            hosts = None
        elif args.hosts is not None:
            hosts = parse_host_list(args.hosts)
        elif args.hostfile is not None:
            try:
                with open(args.hostfile) as f:
                    text = f.read()
            except OSError as exc:
                raise UsageError(f"cannot read --hostfile {args.hostfile}: {exc.strerror}")
            hosts = parse_hostfile(text, args.hostfile)
        else:
            hosts = slurm_allocation(os.environ)  # inside salloc/sbatch: the allocation's hosts
        if hosts is None and args.np is None and elastic is None:
            raise UsageError("-np N is required when no hosts are given")
        np = args.np if args.np is not None else sum(h.slots for h in hosts) if hosts else 1
        if hosts is not None and np > sum(h.slots for h in hosts):
            listing = ",".join(f"{h.name}:{h.slots}" for h in hosts)
            raise UsageError(f"-np {np} is more than the {sum(h.slots for h in hosts)} "
                             f"slots of {listing}")
    except HostSpecError as exc:
        raise UsageError(str(exc)) from None
    for flag, path in (("--ssh-identity-file", args.ssh_identity_file),
                       ("--ssh-config-file", args.ssh_config_file)):
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag} {path}: no such file")
    interfaces = None
    if args.network_interface is not None:
        interfaces = [name.strip() for name in args.network_interface.split(",") if name.strip()]
        if not interfaces:
            raise UsageError("--network-interface needs at least one interface name")

    knobs = CoreKnobs(
        fusion_threshold_mb=args.fusion_threshold_mb,
        cycle_time_ms=args.cycle_time_ms,
        cpu_channels=args.cpu_channels,
        timeline_filename=args.timeline_filename,
        autotune=args.autotune,
        autotune_log_file=args.autotune_log_file,
        verbose=args.verbose,
        stall_check_time_seconds=0 if args.stall_check is False else args.stall_check_time_seconds,
        stall_shutdown_time_seconds=0 if args.stall_check is False else args.stall_shutdown_time_seconds,
        cache_capacity=0 if args.disable_cache else args.cache_capacity,
        log_level=args.log_level,
        hierarchical_allreduce=args.hierarchical_allreduce,
        straggler_report_seconds=args.straggler_report_seconds,
        metrics_port=args.metrics_port,
    )
    extra_env = {}
    if args.gloo_timeout_seconds is not None:
        extra_env["HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS"] = f"{args.gloo_timeout_seconds:g}"
    config = JobConfig(
        command=command, np=np, hosts=hosts,
        ssh=SshOptions(port=args.ssh_port, identity_file=args.ssh_identity_file,
                       config_file=args.ssh_config_file),
        network_interface=interfaces[0] if interfaces else None, network_interfaces=interfaces,
        discovery=not args.no_network_discovery, start_timeout=args.start_timeout,
        grace_period=args.grace_period, output_dir=args.output_filename, knobs=knobs,
        verbose=args.verbose, output_timestamps=args.prefix_output_with_timestamp, extra_env=extra_env,
        elastic=elastic,
    )
    return config, args


def _elastic_config(args) -> Optional[ElasticConfig]:
    flags = {"--min-np": args.min_np, "--max-np": args.max_np, "--slots-per-host": args.slots_per_host,
             "--elastic-timeout": args.elastic_timeout, "--reset-limit": args.reset_limit,
             "--blacklist-cooldown-range": args.blacklist_cooldown_range}
    if args.host_discovery_script is None:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} needs --host-discovery-script (elastic mode)")
        return None
    if args.hosts is not None or args.hostfile is not None:
        raise UsageError("--host-discovery-script replaces -H/--hostfile: give one or the other")
    min_np = args.min_np or args.np or 1
    if args.max_np is not None and args.max_np < min_np:
        raise UsageError(f"--max-np {args.max_np} is less than --min-np {min_np}")
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None and cooldown[0] > cooldown[1]:
        raise UsageError(f"--blacklist-cooldown-range {cooldown[0]:g} {cooldown[1]:g}: LO is above HI")
    return ElasticConfig(
        discovery_script=args.host_discovery_script, min_np=min_np, max_np=args.max_np,
        slots_per_host=args.slots_per_host or 1,
        timeout=args.elastic_timeout if args.elastic_timeout is not None else DEFAULT_ELASTIC_TIMEOUT,
        reset_limit=args.reset_limit, cooldown_range=tuple(cooldown) if cooldown else None)


def _usage_error(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message} (see {PROG} --help)\n")
    sys.stderr.flush()
    return 2


def _allow_descriptors(ranks: int) -> None:
    """The launcher holds about three descriptors per local rank (its two pipes and its store
    connection: Note [One thread watches the ranks] in io_loop.py), past the common soft limit
    of 1,024 from about 300 ranks: raise the soft limit to the hard one, as far as it goes."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 4 * ranks + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    except (ImportError, ValueError, OSError):
        pass  # not everywhere: the launch then fails on EMFILE, naming it


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the hvdliterun console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, args = parse_config(argv)
    except UsageError as exc:
        return _usage_error(str(exc))
    if config is None:
        if args.dump is not None:
            from .dump import dump_command
            return dump_command(args.dump, sys.stdout, sys.stderr)
        if args.version:
            from hvdlite import __version__
            print(f"hvdlite {__version__}")
            return 0
        from .check_build import check_build
        return check_build(sys.stdout)

    from .job import run_job  # after parsing, so --help stays instant
    _allow_descriptors(config.np)
    try:
        result = run_job(config)
    except (HostSpecError, NetworkError) as exc:
        return _usage_error(str(exc))
    message = result.message()
    if message:
        first, *more = message.split("\n")
        sys.stderr.write(f"{PROG}: error: {first}\n" + "".join(f"{PROG}: {line}\n" for line in more))
        sys.stderr.flush()
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
