"""The engine's pure logic in one process: negotiation, planning, encoding, configuration."""

import pytest
import torch

import hvdlite  # noqa: F401  (imports torch, then the extension)
from hvdlite import _core

FLOAT, DOUBLE = 6, 7  # c10::ScalarType values
ALLREDUCE, ALLGATHER, BROADCAST = 0, 1, 2


def req(name, **kw):
    d = {"name": name, "kind": ALLREDUCE, "dtype": FLOAT, "shape": [4], "op": 1}
    d.update(kw)
    return d


def msg(*requests, flags=0, clock_ms=0):
    return {"requests": list(requests), "flags": flags, "clock_ms": clock_ms}


def test_negotiation_emits_a_name_once_every_rank_has_requested_it():
    c = _core._ControllerHarness(3)
    r = c.round([msg(req("a"), req("b")), msg(req("b")), msg()])
    assert r["ready"] == [] and r["pending"] == 2
    r = c.round([msg(), msg(req("a")), msg(req("b"), req("a"))])
    assert [i["name"] for i in r["ready"]] == ["b", "a"]  # order of the last request, rank order
    assert all(i["code"] == 0 for i in r["ready"]) and r["pending"] == 0


def test_negotiation_mismatch_names_field_ranks_and_values():
    c = _core._ControllerHarness(3)
    r = c.round([msg(req("w", shape=[17, 3])), msg(req("w", shape=[17, 3])), msg(req("w", shape=[18, 3]))])
    (item,) = r["ready"]
    assert item["code"] == 2
    assert item["message"] == "allreduce of 'w': shape mismatch: ranks 0, 1 have [17, 3]; rank 2 has [18, 3]"


@pytest.mark.parametrize("field,a,b,text", [
    ("dtype", FLOAT, DOUBLE, "dtype mismatch: rank 0 has Float; rank 1 has Double"),
    ("op", 1, 4, "reduce op mismatch: rank 0 has Sum; rank 1 has Max"),
    ("kind", ALLREDUCE, BROADCAST, "operation mismatch: rank 0 has allreduce; rank 1 has broadcast"),
    ("postscale", 1.0, 0.5, "postscale factor mismatch: rank 0 has 1; rank 1 has 0.5"),
    ("device_type", 0, 1, "device mismatch: rank 0 has cpu; rank 1 has cuda"),
])
def test_negotiation_detects_each_field(field, a, b, text):
    c = _core._ControllerHarness(2)
    r = c.round([msg(req("t", **{field: a})), msg(req("t", **{field: b}))])
    assert text in r["ready"][0]["message"]


def test_negotiation_broadcast_root_and_allgather_first_dimension():
    c = _core._ControllerHarness(2)
    r = c.round([msg(req("b", kind=BROADCAST, root=0)), msg(req("b", kind=BROADCAST, root=1))])
    assert "root rank mismatch: rank 0 has 0; rank 1 has 1" in r["ready"][0]["message"]
    r = c.round([msg(req("g", kind=ALLGATHER, shape=[2, 5])), msg(req("g", kind=ALLGATHER, shape=[7, 5]))])
    assert r["ready"][0]["code"] == 0 and r["ready"][0]["rank_dim0"] == [2, 7]
    r = c.round([msg(req("h", kind=ALLGATHER, shape=[2, 5])), msg(req("h", kind=ALLGATHER, shape=[2, 6]))])
    assert "shape beyond the first dimension mismatch" in r["ready"][0]["message"]


def test_round_flags_shutdown_quiet_and_outstanding():
    c = _core._ControllerHarness(2)
    r = c.round([msg(flags=2), msg(flags=2)])
    assert r["quiet"] and r["all_outstanding"] and not r["shutdown"]
    r = c.round([msg(flags=1), msg()])
    assert r["shutdown"] and not r["all_outstanding"]


def test_stall_warns_then_fails_naming_missing_ranks():
    c = _core._ControllerHarness(3, 1.0, 3.0)
    c.round([msg(req("s"), clock_ms=0), msg(req("s")), msg()])
    r = c.round([msg(clock_ms=1500), msg(), msg()])
    assert "allreduce 's' (waiting 1 s): missing rank 2, submitted by ranks 0, 1" in r["stall_warning"]
    assert r["ready"] == []
    r = c.round([msg(clock_ms=3100), msg(), msg()])
    (item,) = r["ready"]
    assert item["code"] == 4 and "missing rank 2" in item["message"]
    assert r["pending"] == 0


def test_planner_fuses_by_key_up_to_threshold():
    ready = [req("a", shape=[10]), req("b", shape=[10], dtype=DOUBLE), req("c", shape=[10]),
             req("d", shape=[10], op=4), req("e", shape=[10]), req("x", failed=True),
             req("g", kind=ALLGATHER, shape=[10]), req("h", kind=ALLGATHER, shape=[10])]
    assert _core._plan(ready, 1 << 20) == [["a", "c", "e"], ["b"], ["d"], ["x"], ["g"], ["h"]]
    # 10 floats = 40 bytes: a threshold of 80 bytes fits two
    assert _core._plan([req(n, shape=[10]) for n in "abcde"], 80) == [["a", "b"], ["c", "d"], ["e"]]
    assert _core._plan([req(n, shape=[10]) for n in "abc"], 0) == [["a"], ["b"], ["c"]]
    # a tensor larger than the threshold gets a batch of its own
    assert _core._plan([req("s", shape=[2]), req("big", shape=[1000]), req("t", shape=[2])], 100) == \
        [["s", "t"], ["big"]]
    # broadcasts fuse per root
    b = [req("p", kind=BROADCAST, root=0), req("q", kind=BROADCAST, root=1), req("r", kind=BROADCAST, root=0)]
    assert _core._plan(b, 1 << 20) == [["p", "r"], ["q"]]


def test_planner_lets_streamed_cpu_allreduces_grow_to_four_thresholds():
    # Note [Streaming a batch through its buffer] (csrc/cpu_route.h): 10 floats = 40 bytes
    cpu = [req(n, shape=[10]) for n in "abcdefghij"]
    assert _core._plan(cpu, 80) == [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"], ["i", "j"]]
    assert _core._plan(cpu, 80, cpu_streams=True) == [list("abcdefgh"), ["i", "j"]]
    # device tensors, reducescatters and broadcasts keep the threshold; so does 0 (no fusion)
    cuda = [req(n, shape=[10], device_type=1) for n in "abc"]
    assert _core._plan(cuda, 80, cpu_streams=True) == [["a", "b"], ["c"]]
    scatter = [req(n, shape=[10], kind=4) for n in "abc"]
    assert _core._plan(scatter, 80, cpu_streams=True) == [["a", "b"], ["c"]]
    assert _core._plan(cpu[:3], 0, cpu_streams=True) == [["a"], ["b"], ["c"]]
    huge = 2**62  # four times it saturates instead of overflowing
    assert _core._plan(cpu[:3], huge, cpu_streams=True) == [["a", "b", "c"]]


def test_message_encoding_round_trips():
    m = msg(req("grad.w", shape=[3, 0, 2], prescale=0.5, group="G", group_size=3),
            req("ünïcödé-" + "x" * 5000, kind=BROADCAST, root=2), req("", shape=[]), flags=3, clock_ms=123)
    decoded = _core._decode_message(_core._encode_message(m))
    assert decoded["flags"] == 3 and decoded["clock_ms"] == 123
    assert [r["name"] for r in decoded["requests"]] == [r["name"] for r in m["requests"]]
    assert decoded["requests"][0]["shape"] == [3, 0, 2] and decoded["requests"][0]["group_size"] == 3
    assert decoded["requests"][1]["root"] == 2 and decoded["requests"][2]["shape"] == []


def test_malformed_messages_are_errors_not_crashes():
    good = _core._encode_message(msg(req("a"), req("b")))
    for cut in range(len(good)):
        with pytest.raises(RuntimeError, match="malformed control message"):
            _core._decode_message(good[:cut])
    with pytest.raises(RuntimeError, match="trailing bytes"):
        _core._decode_message(good + b"\0")
    # a request count the bytes cannot hold (each request takes at least 9) is rejected in the
    # header, before any request is made: 1000 claimed, 200 bytes follow
    empty = _core._encode_message(msg())
    with pytest.raises(RuntimeError, match="malformed control message header"):
        _core._decode_message(empty[:-4] + (1000).to_bytes(4, "little") + b"\1" * 200)
    import random
    rng = random.Random(0)
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            _core._decode_message(bytes(data))
        except RuntimeError as exc:
            assert "malformed control message" in str(exc)


def test_config_defaults_and_strict_parsing():
    c = _core._parse_config({})
    assert c["fusion_threshold_bytes"] == 64 * 1024 * 1024 and 0 < c["cycle_time_ms"] <= 5
    c = _core._parse_config({"HVDLITE_FUSION_THRESHOLD": "1024", "HVDLITE_CYCLE_TIME": "2.5",
                             "HVDLITE_LOG_LEVEL": "debug"})
    assert c["fusion_threshold_bytes"] == 1024 and c["cycle_time_ms"] == 2.5 and c["log_level"] == 1
    for var, value in [("HVDLITE_FUSION_THRESHOLD", "64MB"), ("HVDLITE_FUSION_THRESHOLD", "-1"),
                       ("HVDLITE_CYCLE_TIME", "fast"), ("HVDLITE_CYCLE_TIME", "nan"),
                       ("HVDLITE_LOG_LEVEL", "loud"), ("HVDLITE_STALL_CHECK_TIME_SECONDS", "1e999"),
                       ("HVDLITE_IDLE_HEARTBEAT_MS", "0")]:
        with pytest.raises(ValueError, match=f"invalid {var}='{value}'"):
            _core._parse_config({var: value})


def test_response_cache_abbreviates_repeated_requests_and_falls_back_on_change():
    c = _core._ControllerHarness(2, 0.0, 0.0, 8)
    full_size, names = c.wire(0, msg(req("grad.w", shape=[64, 64])))
    assert names == ["grad.w"]
    c.round([msg(req("grad.w", shape=[64, 64])), msg(req("grad.w", shape=[64, 64]))])
    cached_size, names = c.wire(0, msg(req("grad.w", shape=[64, 64])))
    assert names == ["grad.w"] and cached_size < full_size - 20
    changed_size, _ = c.wire(0, msg(req("grad.w", shape=[64, 65])))
    assert changed_size == full_size  # another shape travels in full
    # eviction: capacity 8, the least recently used name goes first
    for i in range(8):
        c.round([msg(req(f"n{i}")), msg(req(f"n{i}"))])
    assert c.wire(0, msg(req("grad.w", shape=[64, 64])))[0] == full_size
    assert c.wire(0, msg(req("n7")))[0] < c.wire(0, msg(req("n8")))[0]
    # a name used again moves to the front: with n0 used again, a new name evicts n1, not n0
    c.round([msg(req("n0")), msg(req("n0"))])
    c.round([msg(req("x")), msg(req("x"))])
    assert c.wire(0, msg(req("n0")))[0] < c.wire(0, msg(req("n1")))[0]
    assert c.wire(0, msg(req("n2")))[0] == c.wire(0, msg(req("n0")))[0]  # still cached


def test_cache_disabled_sends_everything_in_full():
    c = _core._ControllerHarness(2, 0.0, 0.0, 0)
    first = c.wire(0, msg(req("a")))[0]
    c.round([msg(req("a")), msg(req("a"))])
    assert c.wire(0, msg(req("a")))[0] == first


def test_items_are_inlined_only_when_every_rank_sent_its_bytes():
    c = _core._ControllerHarness(2)
    r = c.round([msg(req("i", payload=b"\0" * 16)), msg(req("i", payload=b"\1" * 16))])
    assert r["ready"][0]["inlined"]
    r = c.round([msg(req("j", payload=b"\0" * 16)), msg(req("j"))])
    assert not r["ready"][0]["inlined"]


def test_config_cache_and_inline_knobs():
    c = _core._parse_config({"HVDLITE_CACHE_CAPACITY": "0", "HVDLITE_INLINE_BYTES": "0"})
    assert c["cache_capacity"] == 0 and c["inline_bytes"] == 0
    with pytest.raises(ValueError, match="invalid HVDLITE_INLINE_BYTES='9999999'"):
        _core._parse_config({"HVDLITE_INLINE_BYTES": "9999999"})


# ---- autotune (Note [Autotune] in csrc/autotune.h) ----------------------------------------------

MIB = 1 << 20


def drive(tuner, rate_of, limit=400):
    """Feeds the tuner rounds of 0.1 s that move rate_of(current params) bytes per second."""
    now = 0.0
    tuner.record(0, now)
    for _ in range(limit):
        if tuner.done:
            return
        now += 0.1
        tuner.record(int(rate_of(tuner.current) * 0.1), now)
    raise AssertionError("autotune did not finish")


def test_autotune_finds_the_best_threshold_then_the_best_cycle_time():
    def rate(params):  # peaks at 8 MiB and 1 ms
        threshold, cycle = params
        return 1e9 - abs(threshold - 8 * MIB) * 10 - abs(cycle - 1.0) * 1e8

    t = _core._Autotuner(64 * MIB, 0.5, sample_seconds=0.3)
    assert t.current == (64 * MIB, 0.5) and not t.done
    drive(t, rate)
    assert t.current == (8 * MIB, 1.0)
    phases = [s[0] for s in t.samples()]
    assert phases[0] == "warmup" and phases.count("confirm") == 4
    thresholds = sorted({s[1] for s in t.samples() if s[0] == "threshold"})
    assert thresholds == [m * MIB for m in (1, 2, 4, 8, 16, 32, 64, 128)]
    # every cycle candidate except the starting 0.5 ms, measured already in the threshold phase
    assert sorted({s[2] for s in t.samples() if s[0] == "cycle"}) == [0.1, 0.25, 1.0, 2.0, 4.0]
    assert all(s[4] >= 0.3 for s in t.samples())  # every sample covers the sample time
    assert "8 MiB" in t.summary() and "1 ms" in t.summary()


def test_autotune_keeps_the_start_when_nothing_beats_it():
    def rate(params):  # the starting point is best; every other setting is slower
        return 1e9 if params == (64 * MIB, 0.5) else 5e8

    t = _core._Autotuner(64 * MIB, 0.5, sample_seconds=0.2)
    drive(t, rate)
    assert t.current == (64 * MIB, 0.5)


def test_autotune_confirmation_rejects_a_lucky_sample():
    # 16 MiB looks best once (a noisy sample), but is slower than the start when measured again
    t = _core._Autotuner(64 * MIB, 0.5, sample_seconds=0.3)

    def rate(params):
        if params[0] == 16 * MIB:
            lucky = not any(s[1] == 16 * MIB for s in t.samples())
            return 2e9 if lucky else 1e8
        return 1e9

    drive(t, rate)
    assert t.current == (64 * MIB, 0.5)


def test_autotune_sample_needs_bytes_and_time():
    t = _core._Autotuner(MIB, 0.5, sample_seconds=1.0)
    t.record(999, 0.0)                # the first round only starts the clock
    assert not t.record(10, 0.5)      # not enough time yet
    assert t.record(0, 1.25)          # enough time, and bytes were moved
    assert t.samples() == [("warmup", MIB, 0.5, 10, 1.25)]
    idle = _core._Autotuner(MIB, 0.5, sample_seconds=1.0)
    idle.record(0, 0.0)
    assert not idle.record(0, 5.0)    # time alone is not a sample
    assert idle.record(7, 5.5) and idle.samples()[0][3] == 7


def test_tuned_parameters_travel_in_rank_messages():
    tuned_flag = 4
    m = msg(req("a"), flags=tuned_flag, clock_ms=7)
    m["tuned"] = (8 * MIB, 0.25)
    decoded = _core._decode_message(_core._encode_message(m))
    assert decoded["tuned"] == (8 * MIB, 0.25) and decoded["flags"] == tuned_flag
    plain = _core._encode_message(msg(req("a")))
    assert len(_core._encode_message(m)) == len(plain) + 16
    bad = dict(m, tuned=(-1, 0.25))
    with pytest.raises(RuntimeError, match="malformed control message"):
        _core._decode_message(_core._encode_message(bad))


def test_gather_config():
    c = _core._parse_config({})
    assert c["gather_bytes"] == 4 << 20 and c["gather_max_ms"] == 100
    c = _core._parse_config({"HVDLITE_GATHER_BYTES": "0", "HVDLITE_GATHER_MAX_MS": "2.5"})
    assert c["gather_bytes"] == 0 and c["gather_max_ms"] == 2.5
    for var, value in [("HVDLITE_GATHER_BYTES", "-1"), ("HVDLITE_GATHER_MAX_MS", "soon")]:
        with pytest.raises(ValueError, match=f"invalid {var}='{value}'"):
            _core._parse_config({var: value})


def test_cpu_channels_config():
    assert _core._parse_config({})["cpu_channels"] == 4
    assert _core._parse_config({"HVDLITE_CPU_CHANNELS": "1"})["cpu_channels"] == 1
    for value in ("0", "17", "two"):
        with pytest.raises(ValueError, match=f"invalid HVDLITE_CPU_CHANNELS='{value}'"):
            _core._parse_config({"HVDLITE_CPU_CHANNELS": value})


def test_autotune_config_is_strict():
    c = _core._parse_config({"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_SAMPLE_SECONDS": "0.25",
                             "HVDLITE_AUTOTUNE_LOG": "/tmp/at.csv"})
    assert c["autotune"] and c["autotune_sample_seconds"] == 0.25 and c["autotune_log_path"] == "/tmp/at.csv"
    assert not _core._parse_config({})["autotune"]
    for value in ("2", "yes", "-1"):
        with pytest.raises(ValueError, match=f"invalid HVDLITE_AUTOTUNE='{value}'"):
            _core._parse_config({"HVDLITE_AUTOTUNE": value})


def test_every_job_wide_setting_is_parsed_strictly():
    # Note [One table of settings]: the job-wide list and the parser read the same rows, so
    # each listed variable refuses a value that is no number, naming itself.
    assert len(_core.JOB_WIDE_SETTINGS) == len(set(_core.JOB_WIDE_SETTINGS)) >= 15
    for var in _core.JOB_WIDE_SETTINGS:
        with pytest.raises(ValueError, match=f"invalid {var}='bogus'"):
            _core._parse_config({var: "bogus"})


def test_control_slot_grows_at_once_and_shrinks_after_calm_rounds():
    # Note [Slots sized by the last rounds] (csrc/control_channel.h)
    assert _core._slot_sizes(2, [[0, 0], [100, 2000]]) == [2048, 3072]  # 2000 + 250 + 8 in whole KiB
    big, small = [12_000, 300], [40, 40]
    slots = _core._slot_sizes(2, [big] + [small] * 31 + [small])
    assert slots[:32] == [14_336] * 32 and slots[32] == 2048  # down on the 32nd calm round
    # a round that needs the slot again restarts the count
    slots = _core._slot_sizes(2, [big] + [small] * 20 + [big] + [small] * 31)
    assert set(slots) == {14_336}
    # a smaller need after the calm rounds lands on that need, not on the minimum
    assert _core._slot_sizes(2, [big] + [[5000, 0]] * 32)[-1] == 6144
    # at most 128 KiB per rank per round in slots, never under 2 KiB; corrupt lengths are capped
    assert _core._slot_sizes(2, [[10**6, 0]]) == [65_536]
    assert _core._slot_sizes(64, [[10**6] * 64]) == [2048]
    assert _core._slot_sizes(3, [[2**62, 2**63 - 1, 0]]) == [43_690]
