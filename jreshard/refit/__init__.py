"""Versioned refits between a source program (trainer) and a destination program (server).

- :mod:`jreshard.refit.group`: :class:`RefitGroup`, forming a group over MPI or NIXL and its refits;
- :mod:`jreshard.refit.decl`: the declarations every process exchanges, and their checks;
- :mod:`jreshard.refit.background`: a pull received while the server keeps stepping, then one flip;
- :mod:`jreshard.refit.views`: a refit through a view (casts, fused parameters) of the source's tree.
"""

from jreshard.refit.background import PullHandle as PullHandle
from jreshard.refit.background import ServeReport as ServeReport
from jreshard.refit.background import Shadow as Shadow
from jreshard.refit.group import RefitGroup as RefitGroup
from jreshard.refit.group import Role as Role

__all__ = ["PullHandle", "RefitGroup", "Role", "ServeReport", "Shadow"]
