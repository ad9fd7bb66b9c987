"""Builds the optional Cython core (mindio._native._core).

The extension is a speed-up, never a requirement: if it cannot be compiled the package still installs
and mindio._native falls back to its pure-Python implementation (same functions, same results).
"""
import os

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the build machine
            print(f"WARNING: mindio native core not built ({exc}); using the pure-Python fallback")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # pragma: no cover
            print(f"WARNING: building {ext.name} failed ({exc}); using the pure-Python fallback")


def extensions():
    if os.environ.get("MINDIO_NO_NATIVE") == "1" or not os.path.exists("mindio/_native/_core.pyx"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    from setuptools import Extension

    ext = Extension(
        "mindio._native._core",
        ["mindio/_native/_core.pyx"],
        depends=["mindio/_native/_crc_simd.h", "mindio/_native/_copy_nt.h"],
        include_dirs=["mindio/_native"],
        extra_compile_args=["-O3", "-pthread"],
        extra_link_args=["-pthread"],
        libraries=["z"],
    )
    # the controller's BEATS reader (mindio/ttp/wire/beats.py); numpy through its Python API only
    beats = Extension("mindio._native._beats", ["mindio/_native/_beats.pyx"], extra_compile_args=["-O3"])
    return cythonize([ext, beats], language_level=3, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
