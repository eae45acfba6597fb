"""``python -m nbflash``: the demo. With no GPU it re-runs itself in Numba's CUDA simulator.

``python -m nbflash prebuild``: compile the kernels ahead of their first use (``nbflash.prebuild``).
"""

import os
import sys

from . import runtime

if sys.argv[1:2] == ["prebuild"]:
    from .prebuild import main as prebuild

    sys.exit(prebuild(sys.argv[2:]))

if not runtime.SIMULATOR and not runtime.gpu_present():
    # Numba reads NUMBA_ENABLE_CUDASIM when first imported, which importing nbflash already did:
    # start again with it set.
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "nbflash", *sys.argv[1:]])

from .demo import main  # noqa: E402

main()
