"""The one compiled part of jreshard: float32 <-> bfloat16 casts for the views executor.

It is optional: where no C compiler is found the build goes on without it and
``jreshard.views.native`` falls back to numpy's casts (same bits, slower).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "jreshard.views._casts",
            ["jreshard/views/_casts.c"],
            optional=True,
            extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
        )
    ]
)
