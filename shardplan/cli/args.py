"""What the command line's subcommands share: the ``--axes`` parser, and fake CPU devices asked
for before jax starts its backends."""

from __future__ import annotations

import os


def parse_axes(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit():
            raise ValueError(f"--axes {text!r}: write it as name=size,name=size (e.g. data=2,model=4)")
        out[name.strip()] = int(size)
    return out


def fake_cpu_devices(n: int | None) -> None:
    """Ask for ``n`` fake CPU devices unless XLA_FLAGS already says how many, and keep JAX on its
    CPU backend unless JAX_PLATFORMS says otherwise (before jax starts its backends): planning
    runs on fake CPU devices, and the GPU and TPU compilers (``--target``) need no backend of
    their own, so an installed CUDA plugin must not go looking for a driver."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n is not None and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    if not os.environ.get("JAX_PLATFORMS"):
        import jax
        jax.config.update("jax_platforms", "cpu")
