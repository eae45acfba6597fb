"""``python -m nbflash``: the demo. With no GPU it re-runs itself in Numba's CUDA simulator."""

import os
import sys

from . import runtime

if not runtime.SIMULATOR and not runtime.gpu_present():
    # Numba reads NUMBA_ENABLE_CUDASIM when first imported, which importing nbflash already did:
    # start again with it set.
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "nbflash", *sys.argv[1:]])

from .demo import main  # noqa: E402

main()
