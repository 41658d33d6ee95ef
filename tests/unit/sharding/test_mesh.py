"""The mesh: built by jax.make_mesh, Auto axis types, the devices in the order given on CPU."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from expertax.config.schema import MESH_AXES
from expertax.preflight import load_config
from expertax.sharding import make_mesh

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "keys, shape",
    [
        (dict(ici_fsdp_parallelism=8), (1, 1, 8, 1, 1, 1)),
        (dict(ici_expert_parallelism=4, ici_fsdp_parallelism=2), (1, 1, 2, 1, 4, 1)),
        (
            dict(
                ici_data_parallelism=2,
                ici_expert_parallelism=2,
                ici_tensor_parallelism=2,
                ici_fsdp_parallelism=1,
            ),
            (1, 2, 1, 1, 2, 2),
        ),  # fmt: skip
        (dict(ici_context_parallelism=4, ici_fsdp_parallelism=2), (1, 1, 2, 4, 1, 1)),
    ],
)
def test_mesh_axes_types_and_device_order(keys, shape):
    c = load_config(overrides={"model_name": "mixtral-tiny", **keys})
    mesh = make_mesh(c)
    assert mesh.axis_names == MESH_AXES
    assert tuple(mesh.axis_sizes) == shape
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # The parity tables depend on this order: the devices as listed, reshaped.
    assert np.array_equal(ids, np.arange(8).reshape(shape))


def test_a_subset_of_devices_keeps_its_order():
    c = load_config(overrides={"model_name": "mixtral-tiny", "ici_fsdp_parallelism": 4})
    devices = jax.devices()[:4][::-1]
    mesh = make_mesh(c, devices)
    assert [d.id for d in mesh.devices.flat] == [3, 2, 1, 0]
