"""torchtitan integration: the ``"fp8flow"`` model converter, the offline datasets, the ``fp8flow_gpu`` flavor.

Importing this package registers them, which is what ``--experimental.custom_import
fp8flow_ao.torchtitan`` (or ``custom_import`` under ``[experimental]`` in a TOML file) does in
torchtitan's trainer. See ``torchtitan_configs/*.toml`` for complete configs.
"""

from __future__ import annotations

from torchtitan.protocols import model_converter

from fp8flow_ao.torchtitan.converter import CONVERTER_NAME, FP8FlowConverter, fqn_filter
from fp8flow_ao.torchtitan.dataset import DATASET_NAME, register_dataset
from fp8flow_ao.torchtitan.flavors import FP8FLOW_GPU, register_flavors

__all__ = ["CONVERTER_NAME", "DATASET_NAME", "FP8FLOW_GPU", "FP8FlowConverter", "fqn_filter", "register"]


def register() -> None:
    """Register the converter, the datasets and the flavor with torchtitan (idempotent)."""
    # register_model_converter asserts on a second registration; importlib may re-run this module
    # (e.g. torchtitan's custom_import after a test imported it), so check the registry first.
    if CONVERTER_NAME not in model_converter._registry_model_converter_cls:
        model_converter.register_model_converter(FP8FlowConverter, CONVERTER_NAME)
    register_dataset()
    register_flavors()


register()
