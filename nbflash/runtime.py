"""Where kernels run: a CUDA GPU through CuPy and Numba, or Numba's CUDA simulator on the CPU.

The simulator is chosen by the environment variable NUMBA_ENABLE_CUDASIM=1, which Numba reads when it
is first imported; nbflash never switches it behind the caller's back (``python -m nbflash`` and the
tests do, before importing Numba, when no GPU is present).
"""

from numba import config

SIMULATOR = bool(config.ENABLE_CUDASIM)

# DLPack device types (dlpack.h): where an exported tensor's memory lives.
DLPACK_CUDA = 2
DLPACK_CUDA_MANAGED = 13


def gpu_present():
    """True when CuPy can see a CUDA GPU. Imports neither Numba's CUDA driver nor anything heavy."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


_cupy = None


def cupy():
    """The CuPy module (imported on first use), or a clear error when it cannot be used."""
    global _cupy
    if _cupy is None:
        try:
            import cupy as module
        except ImportError as error:
            raise RuntimeError(
                "nbflash needs CuPy on a GPU: pip install 'nbflash[cuda12]' or 'nbflash[cuda13]' "
                f"({error}); without a GPU, set NUMBA_ENABLE_CUDASIM=1 before Numba is imported to run the "
                "kernels on the CPU in Numba's CUDA simulator, on NumPy arrays"
            ) from None
        if not gpu_present():
            raise RuntimeError(
                "no CUDA GPU is visible; to run on the CPU in Numba's CUDA simulator, set "
                "NUMBA_ENABLE_CUDASIM=1 before Numba is imported and pass NumPy arrays"
            )
        _cupy = module
    return _cupy
