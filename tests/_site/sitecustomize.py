"""Imported at start-up by every Python process the suite starts (tests/conftest.py puts this
folder on PYTHONPATH).

Note [Test processes skip the last collection]
A process that has imported torch spends about 0.25 s of CPU at exit in the interpreter's final
cyclic collection, which walks every object torch made (measured: 1.04 s for `import torch` and
exit, 0.81 s with the objects frozen first); the suite starts hundreds of such processes, on two
cores. Registered first, this handler runs after every other exit handler (hvdlite's shutdown
included) and freezes what is left, so the final collection skips it. Python does not promise
finalizers at exit, and hvdlite relies on none: what a test checks is left clean after a job
(segments, files, processes) is cleaned by shutdown code, not by the collector.
"""
import atexit
import gc

atexit.register(gc.freeze)
