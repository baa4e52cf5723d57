"""hvdliterun --check-build: what this installation can do, printed as a short table."""
from typing import IO


def _hvdlite_version() -> str:
    try:
        from importlib.metadata import version
        return version("hvdlite")
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        pass
    try:
        import hvdlite
        return getattr(hvdlite, "__version__", "unknown version")
    except Exception as exc:  # the extension may not be built
        return f"not importable ({type(exc).__name__}: {exc})"


def _mark(flag: bool) -> str:
    return "[X]" if flag else "[ ]"


def check_build(out: IO[str]) -> int:
    """Print versions and available backends; always returns 0."""
    lines = [f"hvdlite: {_hvdlite_version()}"]
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:
        lines.append(f"torch: not importable ({type(exc).__name__}: {exc})")
        out.write("\n".join(lines) + "\n")
        return 0
    available = dist.is_available()
    cuda = torch.cuda.is_available()
    lines += [
        f"torch: {torch.__version__}",
        "",
        "Available backends:",
        f"    {_mark(available and dist.is_gloo_available())} Gloo (CPU tensors)",
        f"    {_mark(available and dist.is_nccl_available())} NCCL (CUDA tensors)",
        "",
        "Devices:",
        f"    {_mark(cuda)} CUDA" + (
            f" {torch.version.cuda}, {torch.cuda.device_count()} device(s)" if cuda else
            (f" (built for CUDA {torch.version.cuda}, no device visible)"
             if torch.version.cuda else " (CPU-only torch build)")),
    ]
    out.write("\n".join(lines) + "\n")
    return 0
