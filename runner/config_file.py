"""horovodrun's --config-file: a YAML file of launcher settings, read into hvdliterun's flags.

The keys are horovodrun's (sections params, autotune, timeline, stall_check, logging); flags
given on the command line win over the file. Keys hvdlite has no use for (hierarchical
allgather, library options for MPI or NCCL streams) are accepted and ignored; an unknown
section or key is an error naming it. Needs PyYAML (`pip install pyyaml`), imported only here.
"""
from typing import Any, Dict

from hvdlite.exceptions import ConfigFileError

# section -> key -> argparse destination (None: accepted, no effect in hvdlite)
_KEYS = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity", "hierarchical_allreduce": "hierarchical_allreduce",
               "hierarchical_allgather": None},
    "autotune": {"enabled": "autotune", "log_file": "autotune_log_file", "warmup_samples": None,
                 "steps_per_sample": None, "bayes_opt_max_samples": None, "gaussian_process_noise": None},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "stall_check", "warning_time_seconds": "stall_check_time_seconds",
                    "shutdown_time_seconds": "stall_shutdown_time_seconds"},
    "logging": {"level": "log_level", "hide_timestamp": None},
    "library_options": {"mpi_threads_disable": None, "num_nccl_streams": None, "thread_affinity": None,
                        "gloo_timeout_seconds": None},
}


def read(path: str) -> Dict[str, Any]:
    """argparse destination -> value, from horovodrun's YAML config file at `path`."""
    try:
        import yaml
    except ImportError:
        raise ConfigFileError("--config-file needs PyYAML: pip install pyyaml") from None
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigFileError(f"--config-file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config-file {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config-file {path}: expected sections of keys")
    values = {}
    for section, keys in data.items():
        if section not in _KEYS:
            raise ConfigFileError(f"--config-file {path}: unknown section {section!r} "
                                  f"(known: {', '.join(_KEYS)})")
        for key, value in (keys or {}).items():
            if key not in _KEYS[section]:
                raise ConfigFileError(f"--config-file {path}: unknown key {section}.{key}")
            dest = _KEYS[section][key]
            if dest is not None:
                values[dest] = value
    return values
