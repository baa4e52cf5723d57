"""The progress lines that the elastic jobs append, one JSON object per event, to
$ELASTIC_OUT/progress.<pid> (tests/elastic/harness.py reads them)."""
import json
import os
import time


def recorder(out):
    """note(**fields): appends one line with the time, pid, host and generation added."""
    log = open(os.path.join(out, f"progress.{os.getpid()}"), "a", buffering=1)

    def note(**fields):
        fields.update(t=time.time(), pid=os.getpid(), host=os.environ.get("HVDLITE_HOSTNAME"),
                      generation=int(os.environ.get("HVDLITE_ELASTIC_GENERATION", "-1")))
        log.write(json.dumps(fields) + "\n")
    return note
