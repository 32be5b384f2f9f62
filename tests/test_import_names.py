"""The repository's folders never shadow another distribution's top-level package.

Ray puts the driver's working directory first on every worker's ``sys.path``, so a
``pagefleet serve`` or test run from a clone's root makes ``kernels/`` importable as
``kernels``, the name of a package transformers imports. ``kernels/`` has no
``__init__.py`` (it is only ever ``pagefleet.kernels``): a namespace portion loses to a
regular package anywhere on the path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_repository_root_first_on_the_path_shadows_no_dependency():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import transformers.activations, kernels; "
            "print(kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not Path(out.stdout.strip()).is_relative_to(ROOT / "kernels")


def test_the_kernels_folder_still_imports_as_pagefleet_kernels():
    from pagefleet.kernels import ops

    assert Path(ops.__file__).parent == ROOT / "kernels"
