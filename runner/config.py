"""The launcher's typed configuration: what launch.py parses and job.py runs.

Plain data; no I/O. `core_env()` is the one place flags become HVDLITE_* core variables.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .hosts import Host

DEFAULT_START_TIMEOUT = 120.0
DEFAULT_GRACE_PERIOD = 5.0
DEFAULT_ELASTIC_TIMEOUT = 600.0


@dataclass
class CoreKnobs:
    """Core settings handed to every rank as HVDLITE_* variables; None leaves the default."""

    fusion_threshold_mb: Optional[float] = None
    cycle_time_ms: Optional[float] = None
    cpu_channels: Optional[int] = None
    timeline_filename: Optional[str] = None
    autotune: bool = False
    autotune_log_file: Optional[str] = None
    verbose: bool = False
    stall_check_time_seconds: Optional[float] = None
    stall_shutdown_time_seconds: Optional[float] = None
    cache_capacity: Optional[int] = None
    log_level: Optional[str] = None
    hierarchical_allreduce: bool = False
    straggler_report_seconds: Optional[float] = None
    metrics_port: Optional[int] = None

    def core_env(self) -> Dict[str, str]:
        env = {}
        if self.fusion_threshold_mb is not None:
            env["HVDLITE_FUSION_THRESHOLD"] = str(int(self.fusion_threshold_mb * 1024 * 1024))
        if self.cycle_time_ms is not None:
            env["HVDLITE_CYCLE_TIME"] = f"{self.cycle_time_ms:g}"
        if self.cpu_channels is not None:
            env["HVDLITE_CPU_CHANNELS"] = str(self.cpu_channels)
        if self.timeline_filename is not None:
            env["HVDLITE_TIMELINE"] = self.timeline_filename
        if self.autotune:
            env["HVDLITE_AUTOTUNE"] = "1"
        if self.autotune_log_file is not None:
            env["HVDLITE_AUTOTUNE_LOG"] = self.autotune_log_file
        if self.verbose:
            env["HVDLITE_LOG_LEVEL"] = "debug"
        if self.stall_check_time_seconds is not None:
            env["HVDLITE_STALL_CHECK_TIME_SECONDS"] = f"{self.stall_check_time_seconds:g}"
        if self.stall_shutdown_time_seconds is not None:
            env["HVDLITE_STALL_SHUTDOWN_TIME_SECONDS"] = f"{self.stall_shutdown_time_seconds:g}"
        if self.cache_capacity is not None:
            env["HVDLITE_CACHE_CAPACITY"] = str(self.cache_capacity)
        if self.log_level is not None:
            env["HVDLITE_LOG_LEVEL"] = self.log_level
        if self.hierarchical_allreduce:
            env["HVDLITE_HIERARCHICAL_ALLREDUCE"] = "1"
        if self.straggler_report_seconds is not None:
            env["HVDLITE_STRAGGLER_REPORT_SECONDS"] = f"{self.straggler_report_seconds:g}"
        if self.metrics_port is not None:
            env["HVDLITE_METRICS_PORT"] = str(self.metrics_port)
        return env


@dataclass
class SshOptions:
    port: Optional[int] = None
    identity_file: Optional[str] = None
    config_file: Optional[str] = None  # ssh -F

    def client_argv(self, host: str) -> List[str]:
        """`ssh` with these options and the ones every launcher connection uses, up to `host`."""
        argv = ["ssh"]
        if self.config_file is not None:
            argv += ["-F", self.config_file]
        argv += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file]
        return argv + [host]


@dataclass
class ElasticConfig:
    """hvdliterun's elastic mode (Note [Elastic driver] in elastic.py)."""

    discovery_script: str
    min_np: int = 1
    max_np: Optional[int] = None
    slots_per_host: int = 1
    timeout: float = DEFAULT_ELASTIC_TIMEOUT   # --elastic-timeout
    reset_limit: Optional[int] = None
    cooldown_range: Optional[Tuple[float, float]] = None


@dataclass
class JobConfig:
    """One job: `np` ranks of `command` on `hosts` (None: all local)."""

    command: List[str]
    np: int
    hosts: Optional[List[Host]] = None
    ssh: SshOptions = field(default_factory=SshOptions)
    network_interface: Optional[str] = None       # the rendezvous address only
    network_interfaces: Optional[List[str]] = None  # skips discovery: the ranks' interfaces
    discovery: bool = True                          # Note [Network discovery]
    discovery_timeout: float = 60.0
    start_timeout: float = DEFAULT_START_TIMEOUT
    grace_period: float = DEFAULT_GRACE_PERIOD
    output_dir: Optional[str] = None
    knobs: CoreKnobs = field(default_factory=CoreKnobs)
    extra_env: Dict[str, str] = field(default_factory=dict)  # on top of the launcher's own
    cwd: Optional[str] = None  # None: the launcher's working directory
    verbose: bool = False
    output_timestamps: bool = False
    elastic: Optional[ElasticConfig] = None  # elastic mode: hosts from a discovery script
