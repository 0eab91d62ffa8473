"""jreshard's compiled parts: float32 <-> bfloat16 casts for views, the byte rows of descriptor tables, the
in-process strided copies, the replay of prepared refits, and the delta encode/apply of delta refits.

All are optional: where no C compiler is found the build goes on without them, and
``jreshard.views.native`` and ``jreshard.schedule.kernels`` fall back to numpy (same bytes, slower).
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3"]

setup(
    ext_modules=[
        Extension(
            "jreshard.views._casts",
            ["jreshard/views/_casts.c"],
            depends=["jreshard/_stream.h", "jreshard/_bf16.h"],
            optional=True,
            extra_compile_args=FLAGS,
        ),
        Extension(
            "jreshard.schedule._rows",
            ["jreshard/schedule/_rows.c"],
            depends=["jreshard/_stream.h", "jreshard/_bf16.h", "jreshard/schedule/_rows.h"],
            optional=True,
            extra_compile_args=FLAGS,
        ),
        Extension(
            "jreshard.engine._strided",
            ["jreshard/engine/_strided.c"],
            depends=["jreshard/_stream.h"],
            optional=True,
            extra_compile_args=FLAGS,
        ),
        Extension(
            "jreshard.engine._delta",
            ["jreshard/engine/_delta.c"],
            optional=True,
            extra_compile_args=FLAGS,
        ),
        Extension(
            "jreshard.engine._replay",
            ["jreshard/engine/_replay.c"],
            depends=["jreshard/_stream.h", "jreshard/schedule/_rows.h"],
            optional=True,
            extra_compile_args=FLAGS,
        ),
    ]
)
