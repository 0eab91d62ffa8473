"""Test set-up, once for the whole suite (tests/ and the doctests in jreshard/): 8 CPU devices before jax starts, and
the Hypothesis profiles (``ci`` is derandomized; ``dev``, the default, draws new examples every run; ``deep``, 400
examples a test where the test does not set its own count, for a sweep by hand: ``HYPOTHESIS_PROFILE=deep``)."""

import os
from contextlib import ExitStack

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("deep", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def held_port():
    """``held_port()`` is a free port for a jax coordinator that a child process starts, held (bound, not
    listening, ``SO_REUSEPORT``) until the test ends, so nothing else can take it before the coordinator binds."""
    from jreshard.net.ports import reserved_port

    with ExitStack() as stack:
        yield lambda: stack.enter_context(reserved_port())


@pytest.fixture
def column_major():
    """``column_major(value, sharding)``: ``value`` placed with ``sharding`` in a column-major memory layout, or the
    test skipped where this jax cannot make one (or ignores the layout asked for)."""

    def make(value, sharding):
        import jax
        from jax.experimental.layout import Format, Layout

        try:
            out = jax.device_put(value, Format(Layout(major_to_minor=(1, 0)), sharding))
        except Exception as err:  # pragma: no cover - a backend without custom layouts
            pytest.skip(f"this jax cannot make a column-major array: {err}")
        if tuple(out.format.layout.major_to_minor) == (0, 1):  # pragma: no cover
            pytest.skip("this jax ignored the requested layout")
        return out

    return make


# Scripts a test launches, not modules: they read their command line when imported.
collect_ignore_glob = ["tests/torch_bodies/*.py"]
