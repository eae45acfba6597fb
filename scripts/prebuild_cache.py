"""Fill nbflash's on-disk kernel cache without a GPU: ``python -m nbflash prebuild`` from a checkout.

    python scripts/prebuild_cache.py --cc 9.0 --cache-dir DIR [--headdims 64 128] [--dtypes float16] [--jobs 2]

The machinery is nbflash.prebuild (installed with the package; its --help has the options). The
tuning scripts import ``build_one``, ``configurations``, ``pretend_gpu`` and ``cuda_tool`` from here.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nbflash import prebuild  # noqa: E402
from nbflash.prebuild import build_one, catalogue_variants, configurations, pretend_gpu  # noqa: E402

__all__ = ["build_one", "catalogue_variants", "configurations", "cuda_tool", "pretend_gpu"]


def cuda_tool(name):
    """nbflash.prebuild.cuda_tool, exiting with its message when the tool is missing (what the
    scripts and tests that import it expect)."""
    try:
        return prebuild.cuda_tool(name)
    except prebuild.MissingTool as error:
        sys.exit(str(error))


if __name__ == "__main__":
    sys.exit(prebuild.main(prog="scripts/prebuild_cache.py"))
