"""hvdliterun's command line -> JobConfig, and each rank's environment (pure, one process)."""
import pytest

from hvdlite.runner.environment import Rendezvous, exportable, rank_environment
from hvdlite.runner.hosts import Host, assign_slots
from hvdlite.runner.launch import UsageError, parse_config


def test_parse_config_local_job():
    config, _ = parse_config(["-np", "4", "python", "train.py", "--lr", "0.1"])
    assert config.np == 4 and config.hosts is None
    assert config.command == ["python", "train.py", "--lr", "0.1"]
    assert config.start_timeout == 120 and config.knobs.core_env() == {}


def test_parse_config_hosts_default_np_to_all_slots():
    config, _ = parse_config(["-H", "a:2,b:3", "-p", "22", "-i", __file__, "x"])
    assert config.np == 5 and config.hosts == [Host("a", 2), Host("b", 3)]
    assert config.ssh.port == 22 and config.ssh.identity_file == __file__


def test_parse_config_core_knobs_become_variables():
    config, _ = parse_config(["-np", "1", "--fusion-threshold-mb", "0.5", "--cycle-time-ms", "1",
                              "--timeline-filename", "t.json", "--verbose", "--autotune",
                              "--autotune-log-file", "at.csv", "--cpu-channels", "2",
                              "--stall-check-time-seconds", "60",
                              "--stall-shutdown-time-seconds", "120.5", "x"])
    assert config.knobs.core_env() == {
        "HVDLITE_FUSION_THRESHOLD": str(512 * 1024),
        "HVDLITE_CYCLE_TIME": "1",
        "HVDLITE_CPU_CHANNELS": "2",
        "HVDLITE_TIMELINE": "t.json",
        "HVDLITE_AUTOTUNE": "1",
        "HVDLITE_AUTOTUNE_LOG": "at.csv",
        "HVDLITE_LOG_LEVEL": "debug",
        "HVDLITE_STALL_CHECK_TIME_SECONDS": "60",
        "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "120.5",
    }


def test_parse_config_network_and_ssh_config_flags():
    config, _ = parse_config(["-H", "a:1,b:1", "--ssh-config-file", __file__, "x"])
    assert config.ssh.config_file == __file__ and config.discovery and config.network_interfaces is None
    config, _ = parse_config(["-H", "a:1,b:1", "--network-interfaces", "eth0, ib0", "x"])
    assert config.network_interfaces == ["eth0", "ib0"] and config.network_interface == "eth0"
    config, _ = parse_config(["-H", "a:1,b:1", "--network-interface", "ib0", "--gloo-timeout-seconds", "9",
                              "--log-hide-timestamp", "x"])
    assert config.network_interfaces == ["ib0"] and config.network_interface == "ib0"
    assert config.extra_env == {"HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS": "9"}
    config, _ = parse_config(["-H", "a:1,b:1", "--no-network-discovery", "x"])
    assert not config.discovery


def test_parse_config_takes_horovodruns_flags(capsys):
    config, _ = parse_config(["-np", "2", "--stall-check-warning-time-seconds", "30",
                              "--stall-check-shutdown-time-seconds", "90", "--cache-capacity", "16",
                              "--log-level", "FATAL", "--timeline-mark-cycles", "--gloo",
                              "--prefix-output-with-timestamp", "--fusion-threshold-mb", "0", "x"])
    assert config.knobs.core_env() == {
        "HVDLITE_STALL_CHECK_TIME_SECONDS": "30", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "90",
        "HVDLITE_CACHE_CAPACITY": "16", "HVDLITE_LOG_LEVEL": "error", "HVDLITE_FUSION_THRESHOLD": "0"}
    assert config.output_timestamps
    config, _ = parse_config(["-np", "2", "--no-stall-check", "--disable-cache", "x"])
    assert config.knobs.core_env() == {"HVDLITE_STALL_CHECK_TIME_SECONDS": "0",
                                       "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "0",
                                       "HVDLITE_CACHE_CAPACITY": "0"}
    from hvdlite import __version__
    from hvdlite.runner.launch import main
    assert main(["--version"]) == 0 and main(["-v"]) == 0
    assert capsys.readouterr().out == f"hvdlite {__version__}\n" * 2


@pytest.mark.parametrize("flag", ["--mpi", "--jsrun"])
def test_parse_config_mpi_and_jsrun_say_what_to_use_instead(flag):
    with pytest.raises(UsageError, match=f"{flag}: hvdlite has no MPI or jsrun controller"):
        parse_config(["-np", "2", flag, "x"])


def test_parse_config_reads_horovodruns_config_file_and_flags_win(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "hvd.yaml"
    path.write_text("params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 5\n  hierarchical_allreduce: false\n"
                    "autotune:\n  enabled: true\n  log_file: tune.csv\n"
                    "stall_check:\n  warning_time_seconds: 20\n  shutdown_time_seconds: 40\n"
                    "timeline:\n  filename: t.json\n  mark_cycles: true\nlogging:\n  level: DEBUG\n")
    config, _ = parse_config(["-np", "2", "--config-file", str(path), "--cycle-time-ms", "1", "x"])
    assert config.knobs.core_env() == {
        "HVDLITE_FUSION_THRESHOLD": str(32 << 20), "HVDLITE_CYCLE_TIME": "1", "HVDLITE_AUTOTUNE": "1",
        "HVDLITE_AUTOTUNE_LOG": "tune.csv", "HVDLITE_TIMELINE": "t.json", "HVDLITE_LOG_LEVEL": "debug",
        "HVDLITE_STALL_CHECK_TIME_SECONDS": "20", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "40"}
    path.write_text("params:\n  fusion_threshold: 1\n")
    with pytest.raises(UsageError, match="unknown key params.fusion_threshold"):
        parse_config(["-np", "2", "--config-file", str(path), "x"])


def test_parse_config_check_build_needs_no_command():
    config, args = parse_config(["--check-build"])
    assert config is None and args.check_build


@pytest.mark.parametrize("argv", [["-np", "x", "c"], ["-np", "1"], ["c"], ["-np", "-1", "c"],
                                  ["-np", "3", "-H", "a:1", "c"], ["-H", "a:b", "c"],
                                  ["-np", "1", "-i", "/no/such/key", "c"],
                                  ["-np", "1", "--start-timeout", "0", "c"],
                                  ["-np", "1", "--cycle-time-ms", "nan", "c"],
                                  ["-np", "1", "--ssh-config-file", "/no/such/config", "c"],
                                  ["-np", "1", "--network-interfaces", " , ", "c"]])
def test_parse_config_bad_command_lines_raise_usage_error(argv):
    with pytest.raises(UsageError):
        parse_config(argv)


def test_rank_environment_overrides_contract_and_keeps_the_rest():
    slot = assign_slots([Host("a", 2), Host("b", 2)], 4)[3]
    rdzv = Rendezvous("10.0.0.1", 1234, "s3cret", "10.0.0.1", 5678)
    env = rank_environment({"PATH": "/bin", "RANK": "stale"}, slot, rdzv,
                           {"HVDLITE_CYCLE_TIME": "2"})
    assert env["PATH"] == "/bin" and env["HVDLITE_CYCLE_TIME"] == "2"
    assert (env["RANK"], env["HVDLITE_RANK"], env["HVDLITE_HOSTNAME"]) == ("3", "3", "b")
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"]) == ("1", "2", "4")
    assert (env["HVDLITE_CROSS_RANK"], env["HVDLITE_CROSS_SIZE"]) == ("1", "2")
    assert (env["HVDLITE_RENDEZVOUS_ADDR"], env["HVDLITE_RENDEZVOUS_PORT"]) == ("10.0.0.1", "1234")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "5678")
    assert env["HVDLITE_RENDEZVOUS_SECRET"] == "s3cret"


def test_exportable_drops_host_specific_variables():
    env = {"HOSTNAME": "me", "PWD": "/x", "SHLVL": "2", "_": "/bin/x", "SSH_AUTH_SOCK": "s",
           "DISPLAY": ":0", "BASH_FUNC_f%%": "() {}", "PATH": "/bin", "HVDLITE_RANK": "1",
           "MY_VAR": "v"}
    assert exportable(env) == {"PATH": "/bin", "HVDLITE_RANK": "1", "MY_VAR": "v"}


def test_cycle_time_zero_is_allowed_and_negative_is_not():
    config, _ = parse_config(["-np", "1", "--cycle-time-ms", "0", "x"])
    assert config.knobs.core_env() == {"HVDLITE_CYCLE_TIME": "0"}
    with pytest.raises(UsageError, match="must be a number >= 0"):
        parse_config(["-np", "1", "--cycle-time-ms", "-1", "x"])


def test_hierarchical_allreduce_from_the_flag_and_from_horovodruns_config_file(tmp_path):
    config, _ = parse_config(["-np", "2", "--hierarchical-allreduce", "x"])
    assert config.knobs.core_env() == {"HVDLITE_HIERARCHICAL_ALLREDUCE": "1"}
    pytest.importorskip("yaml")
    path = tmp_path / "hvd.yaml"
    path.write_text("params:\n  hierarchical_allreduce: true\n")
    config, _ = parse_config(["-np", "2", "--config-file", str(path), "x"])
    assert config.knobs.core_env() == {"HVDLITE_HIERARCHICAL_ALLREDUCE": "1"}
