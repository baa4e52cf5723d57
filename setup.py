"""Build and install hvdlite.

The extension hvdlite._core is compiled against the torch that is already installed, so build
without isolation:  pip install --no-build-isolation .   (or -e . for development)
"""
import glob
import hashlib
import os

from setuptools import setup

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - only hit on a misconfigured build
    raise SystemExit(
        "hvdlite builds against the installed torch: install torch first "
        "(pip install torch==2.13.0), then pip install --no-build-isolation ."
    ) from exc



def _write_build_id():
    """csrc/build_id.h: a digest of the native sources, so ranks can tell builds apart.

    hvd.init() refuses a job whose ranks run different builds (Note [Protocol version] in
    csrc/message.h). The header is rewritten only when the digest changes, so an incremental
    build recompiles just the file that includes it.
    """
    digest = hashlib.sha256()
    for path in sorted(glob.glob("csrc/*.cc") + glob.glob("csrc/*.h")):
        if os.path.basename(path) == "build_id.h":
            continue
        with open(path, "rb") as f:
            digest.update(path.encode() + b"\0" + f.read())
    text = f'#pragma once\n#define HVDLITE_BUILD_ID "{digest.hexdigest()[:12]}"\n'
    path = os.path.join("csrc", "build_id.h")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


_write_build_id()
debug = os.environ.get("HVDLITE_DEBUG_BUILD") == "1"
ext = CppExtension(
    name="hvdlite._core",
    sources=sorted(glob.glob("csrc/*.cc")),
    include_dirs=[os.path.abspath("csrc")],
    # Note [Build flags]: setuptools' default -O3 -g doubles compile time and the library size.
    extra_compile_args=["-O0", "-g"] if debug else ["-O2", "-g0"],
)

setup(
    name="hvdlite",
    version="0.1.0",
    description="Horovod-style data-parallel training for PyTorch over torch.distributed",
    packages=["hvdlite", "hvdlite._job", "hvdlite._runtime", "hvdlite.elastic", "hvdlite.ray", "hvdlite.runner"],
    package_dir={"hvdlite": "hvdlite", "hvdlite.runner": "runner"},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["hvdliterun = hvdlite.runner.launch:main"]},
    python_requires=">=3.9",
    # cloudpickle: broadcast_object / allgather_object of lambdas and local classes; pyyaml:
    # hvdliterun --config-file (horovodrun's YAML). horovod.torch depends on both too.
    install_requires=["cloudpickle", "pyyaml"],
    extras_require={"ray": ["ray[train]"], "lightning": ["lightning>=2.1"], "accelerate": ["accelerate"],
                    "metrics": ["prometheus_client"]},
)
