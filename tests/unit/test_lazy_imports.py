"""The package loads its names lazily (Note [Lazy exports] in hvdlite/__init__.py): the launcher
imports neither torch nor the extension, and every public name still resolves."""
import subprocess
import sys

import hvdlite


def _python(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_runner_launch_does_not_import_torch_or_core():
    # A fresh interpreter: this test process has torch loaded already.
    loaded = _python(
        "import sys\n"
        "import hvdlite.runner.launch, hvdlite.runner.job, hvdlite.runner.run_func\n"
        "print(sorted(m for m in ('torch', 'hvdlite._core') if m in sys.modules))")
    assert loaded == "[]"


def test_every_public_name_resolves_and_is_listed_by_dir():
    listed = dir(hvdlite)
    for name in hvdlite.__all__:
        assert getattr(hvdlite, name) is not None
        assert name in listed
    from hvdlite import DistributedOptimizer, allreduce, HorovodInternalError  # noqa: F401
    assert hvdlite.ops.__name__ == "hvdlite.ops"  # submodules stay reachable as attributes


def test_broken_extension_raises_build_instructions_at_first_use():
    out = _python(
        "import sys\n"
        "sys.modules['hvdlite._core'] = None  # makes importing the extension fail\n"
        "import hvdlite\n"
        "try:\n"
        "    hvdlite.allreduce\n"
        "except ImportError as exc:\n"
        "    print(exc)\n")
    assert "hvdlite._core could not be imported" in out
    assert "pip install --no-build-isolation ." in out
