"""Mesh building, logical-axis rules and the activation-constraint helper."""

from expertax.config.schema import MESH_AXES
from expertax.sharding.mesh import check_mesh_fit, make_mesh, mesh_shape
from expertax.sharding.rules import (
    constrain,
    logical_to_spec,
    named_sharding,
    use_rules,
)

__all__ = [
    "MESH_AXES",
    "check_mesh_fit",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "mesh_shape",
    "named_sharding",
    "use_rules",
]
