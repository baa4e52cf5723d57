"""One report from every rank's flight-recorder dump (Note [Dump files] in
hvdlite/_runtime/recorder.py). No torch import: hvdliterun's reporter and ``hvdliterun --dump``
use it. The pending table is the same on every rank (Note [Replicated negotiation] in
csrc/controller.h), so any rank's copy tells which ranks submitted each collective; where a
missing rank is comes from its own record, if it wrote one."""
import json
import os
from typing import Dict, Optional


def read_dir(directory: str) -> Dict[int, dict]:
    """The records of one dump directory, by rank (unreadable files are skipped)."""
    records = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                record = json.load(f)
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def newest(job_dir: str) -> Optional[str]:
    """The most recently written dump directory of a job, or None."""
    root = os.path.join(job_dir, "dumps")
    try:
        found = [os.path.join(root, d) for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
    except OSError:
        return None
    return max(found, key=os.path.getmtime) if found else None


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def where(record: Optional[dict]) -> str:
    """'train.py:42 in main: time.sleep(30)' for a rank's main thread, as its record says."""
    if record is None:
        return "unknown (this rank wrote no dump: dead, stopped, or its recorder is off)"
    at = record.get("where")
    if not at:
        return "unknown (no frame of the main thread outside hvdlite, torch and the standard library)"
    text = f"{at['file']}:{at['line']} in {at['function']}"
    if at.get("code"):
        text += f": {at['code']}"
    if at.get("inside"):
        text += f" (inside {at['inside']})"
    return text


def report(records: Dict[int, dict], size: Optional[int] = None) -> str:
    """The merged report of one dump."""
    if not records:
        return "hvdlite flight recorder: no rank wrote a dump\n"
    first = records[min(records)]
    size = size or first.get("size") or len(records)
    reasons = list(dict.fromkeys(reason for r in records.values() for reason in r.get("reasons", [])))
    lines = [f"hvdlite flight recorder: dump {first['id']} ({'; '.join(reasons) or 'requested'})",
             f"{len(records)} of {size} ranks wrote a record"
             + ("" if len(records) >= size else f" (missing: {_ranks(r for r in range(size) if r not in records)})")]
    labels = list(dict.fromkeys(label for r in records.values() for label in r.get("engines", {})))
    for label in labels:
        for rank, r in sorted(records.items()):  # Note [Point-to-point messages] (csrc/point_to_point.h)
            for line in r.get("engines", {}).get(label, {}).get("point_to_point") or ():
                lines.append(f"engine {label}: rank {rank}: {line}")
        views = [r["engines"][label] for _, r in sorted(records.items()) if label in r.get("engines", {})]
        listed = [v["pending"] for v in views if v.get("pending") is not None]
        # The ranks wrote at slightly different moments: a collective pending in any rank's
        # view is reported, as the rank that saw it wait longest saw it.
        merged = {}
        for view in listed:
            for p in view:
                if p["name"] not in merged or p["waited_s"] > merged[p["name"]]["waited_s"]:
                    merged[p["name"]] = p
        pending = list(merged.values()) if listed else None
        if pending is None:
            lines.append(f"engine {label}: no rank's engine thread listed its pending collectives in time")
            continue
        if not pending:
            lines.append(f"engine {label}: no collective is pending")
            continue
        lines.append(f"engine {label}: {len(pending)} pending collective{'s' if len(pending) > 1 else ''}")
        for p in pending:
            lines.append(f"  {p['op']} '{p['name']}' ({_size(p['bytes'])}), waiting {p['waited_s']:.1f} s: "
                         f"submitted by {_ranks(p['submitted'])}; missing {_ranks(p['missing'])}")
        for missing in sorted({r for p in pending for r in p["missing"]}):
            lines.append(f"  rank {missing} is at {where(records.get(missing))}")
    lines.append("ranks:")
    for rank in sorted(set(range(size)) | set(records)):
        record = records.get(rank)
        if record is None:
            lines.append(f"  rank {rank}: no record")
            continue
        doing = "; ".join(f"engine {label} {v.get('activity', v.get('error', '?'))} "
                          f"({v.get('activity_for_s', 0):.2f} s)" for label, v in record.get("engines", {}).items())
        lines.append(f"  rank {rank} (host {record['host']}, pid {record['pid']}): at {where(record)}"
                     + (f"; {doing}" if doing else ""))
    rounds = next(((label, r["engines"][label]["rounds"]) for _, r in sorted(records.items())
                   for label in r.get("engines", {}) if r["engines"][label].get("rounds")), None)
    if rounds:
        label, recent = rounds
        lines.append(f"last rounds of engine {label} (newest last):")
        for entry in recent[-5:]:
            names = ", ".join(i["name"] + ("" if not i["error"] else " (failed)") for i in entry["items"])
            more = entry["tensors"] - len(entry["items"])
            lag = (f", last rank {entry['last_rank']} ({entry['lag_s'] * 1e3:.1f} ms after the first)"
                   if entry["last_rank"] >= 0 else "")
            lines.append(f"  round {entry['round']}: {entry['tensors']} tensors, {_size(entry['bytes'])}{lag}: "
                         f"{names}{f' and {more} more' if more > 0 else ''}")
    lines.append(f"(every rank's full record, with every thread's stack: {first.get('directory', 'the dump directory')})")
    return "\n".join(lines) + "\n"
